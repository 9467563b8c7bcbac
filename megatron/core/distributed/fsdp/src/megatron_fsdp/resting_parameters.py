"""Placeholders that stand in for sharded (strategy 3) parameters between steps.

Under `optim_grads_params` a group's compute weights are released once the step's backward is done; the
module's parameters are then views into storage of size zero, and reading them would read freed memory. So
while a group is at rest (between steps, or after a forward that no backward will follow), each of its
parameters is swapped out of every module that holds it for a `ReleasedParameter`: same shape, dtype,
requires_grad and attributes, on the meta device (no memory), whose every tensor operation raises an error
naming the parameter and what to use instead. Metadata queries (shape, numel, dtype, ...) keep working, so
counting or listing parameters still does. The real parameter is put back as soon as its group is gathered.
"""

from typing import Dict, List, Tuple

import torch
import torch.nn as nn
from torch._C import DisableTorchFunctionSubclass

# Tensor methods and properties that only read metadata; everything else raises.
_METADATA_QUERIES = frozenset({
    "shape", "dtype", "device", "layout", "requires_grad", "is_leaf", "is_meta", "is_cuda", "is_sparse",
    "is_quantized", "numel", "nelement", "dim", "ndim", "ndimension", "size", "element_size",
    "is_floating_point", "is_complex", "grad", "grad_fn", "names", "__hash__", "__eq__",
})


def _function_name(func) -> str:
    name = getattr(func, "__name__", str(func))
    if name == "__get__":  # a property read: name the property
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


class ReleasedParameter(nn.Parameter):
    """Meta-device stand-in for a parameter whose weights are sharded across data-parallel ranks right now."""

    def __new__(cls, real: nn.Parameter, name: str):
        meta = torch.empty(real.shape, dtype=real.dtype, device="meta")
        placeholder = torch.Tensor._make_subclass(cls, meta, real.requires_grad)
        placeholder.__dict__.update(real.__dict__)  # Megatron attributes (tensor_model_parallel, ...) stay visible
        placeholder.released_name = name
        return placeholder

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = _function_name(func)
        if name in _METADATA_QUERIES:
            with DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        released = next((a for a in args if isinstance(a, ReleasedParameter)), None)
        param_name = getattr(released, "released_name", "?")
        raise RuntimeError(
            f"parameter '{param_name}' is sharded across the data-parallel ranks between steps "
            f"(zero_dp_strategy='optim_grads_params'), so '{name}' cannot read it; use model.state_dict() for "
            f"its values, or read it inside `with model.gathered_parameters():`")

    def __repr__(self):
        return (f"ReleasedParameter('{self.released_name}', shape={tuple(self.shape)}, dtype={self.dtype}: "
                f"sharded between steps)")

    def __reduce_ex__(self, protocol):
        raise RuntimeError(f"parameter '{self.released_name}' is sharded between steps and cannot be pickled; "
                           "save model.state_dict() instead")


class RestingParameters:
    """Swaps each group's parameters in every owning module between the real ones and their placeholders."""

    def __init__(self, groups, owners: Dict[int, List[Tuple[nn.Module, str]]]):
        self._owners = owners
        self._placeholders: Dict[int, ReleasedParameter] = {}
        for group in groups:
            for param, name in zip(group.params, group.names):
                self._placeholders[id(param)] = ReleasedParameter(param, name)
        self._hidden = set()  # ids of groups whose placeholders are installed

    def placeholders(self) -> Dict[int, ReleasedParameter]:
        """id(real parameter) -> its placeholder."""
        return dict(self._placeholders)

    def hide(self, group):
        if id(group) in self._hidden:
            return
        self._install(group, lambda param: self._placeholders[id(param)])
        self._hidden.add(id(group))

    def show(self, group):
        if id(group) not in self._hidden:
            return
        self._install(group, lambda param: param)
        self._hidden.discard(id(group))

    def _install(self, group, choose):
        for param in group.params:
            replacement = choose(param)
            for module, attribute in self._owners.get(id(param), ()):
                module._parameters[attribute] = replacement

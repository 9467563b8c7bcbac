"""What the module shows for sharded (strategy 3) parameters between steps: Shard(0) DTensors of this rank's rows.

Under `optim_grads_params` a group's gathered weights are released after its forward and again once the step's
backward is done, and the module's parameters (views into the released buffer) would read freed memory. So while
a group is released (between steps, and between a unit's forward and its backward, as torch FSDP2 shows its
sharded parameters after resharding) each of its parameters is swapped, in every module that holds it, for a
*resting parameter*: an `nn.Parameter` DTensor on the data-parallel mesh, on the real device, with the
parameter's shape, dtype, requires_grad and attributes, placed `Shard(0)`: its local tensor is this rank's rows,
`layout.chunk_rows(rows, dp_size, dp_rank)` (torch.chunk's split, as torch FSDP2 gives). The row-aligned layout
(layout.py) keeps those rows contiguous in the rank's compute shard, so the local tensor is a view of it, not a
copy: it always holds the current weights (the optimizer step writes them there), costs no memory and no
communication. Being a true `Shard(0)` DTensor, every DTensor operation on it
and on tensors derived from it is exact: `full_tensor()`, `redistribute`, `p.detach().clone()`, `p * 2`,
indexing, reductions along a dim, EMA updates, `torch.nn.utils.clip_grad_norm_`, storage inspection.

A 0-dim parameter cannot be sharded: rank 0 owns it, and every other rank keeps a copy of its value in the
parameter's padding slot of its compute shard (scalar_slots.py). Its resting parameter is placed `Replicate()`
over a view of this rank's slot, so reads see the value on every rank and element-wise in-place ops work
(`with torch.no_grad(): p.clamp_(0, 1)`, `p.fill_`, `torch.nn.init.constant_`); made alike on every rank, as
any write to a replicated DTensor must be, they change the value the forward and the optimizer use (rank 0's).

After a backward, `.grad` of a resting parameter is a DTensor of the same kind over this rank's rows of the
reduced gradient (a 0-dim one's is `Replicate()`; see param_grads.py). The real parameter is put back as soon as
its group is gathered.

The real parameter objects can still be reached while their group is released: references taken before wrapping
(`params = list(model.parameters())`), or taken from the module while it was gathered. They have the full shape
but view a released buffer (storage of size 0), so any torch operation on them would read or write freed memory.
While hidden they are therefore made `ReleasedParameter`s: every torch operation on them except metadata (shape,
dtype, device, requires_grad, .grad) raises an error naming the parameter and the resting parameter to use
instead. (torch FSDP2 leaves the pre-wrapping objects holding their old full weights: reads are stale and writes
are silently lost.)
"""

from typing import Dict, List, Tuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from .dtensor_views import dtensor_over_view, dtensor_parameter


def rows_dtensor(local, like, mesh) -> DTensor:
    """A DTensor of `like`'s shape and stride over `mesh` whose local tensor is `local`, this rank's rows
    (`Shard(0)`), or for a 0-dim `like` this rank's copy of the value (`Replicate()`)."""
    placement = Shard(0) if like.dim() else Replicate()
    return dtensor_over_view(local, mesh, [placement], like.shape, like.stride())


NAME_ATTR = "_megatron_fsdp_name"  # on a real parameter: its name, for the errors of ReleasedParameter

# What a released parameter still answers: its metadata (no element is read or written), its storage too (of
# size 0 while released), for tools that walk the live tensors to count memory.
_METADATA = frozenset({
    "shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "grad_fn", "layout", "ndim", "names",
    "is_meta", "is_cuda", "is_cpu", "is_sparse", "is_quantized", "is_nested", "_version", "size", "dim", "numel",
    "nelement", "stride", "element_size", "itemsize", "nbytes", "is_floating_point", "is_complex", "get_device",
    "requires_grad_", "is_contiguous", "storage_offset", "untyped_storage", "data_ptr",
})


class ReleasedParameter(nn.Parameter):
    """The class of a real parameter while its group is released (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        allowed = name in _METADATA or func is torch.Tensor.__hash__
        if name in ("__get__", "__set__"):  # a property of the tensor: the descriptor's name says which
            setting, name = name == "__set__", getattr(getattr(func, "__self__", None), "__name__", "")
            allowed = name in _METADATA or (setting and name == "data")
        if allowed:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        released = _first_released([*args, *(kwargs or {}).values()])
        if func is torch.Tensor.__repr__:
            return (f"ReleasedParameter('{getattr(released, NAME_ATTR, '?')}', shape={tuple(released.shape)}, "
                    f"dtype={released.dtype}: released by Megatron-FSDP)")
        raise RuntimeError(
            f"parameter '{getattr(released, NAME_ATTR, '?')}' of a Megatron-FSDP model (zero_dp_strategy 3, "
            f"optim_grads_params) holds no weights now: its group is released (between steps, or between a "
            f"forward and its backward), and this object was taken before wrapping or while the weights were "
            f"gathered (`{name}` was used on it). Use the module's current parameters instead "
            "(`model.parameters()`, `model.module.<...>.weight`): Shard(0) DTensors of this rank's rows, which "
            "reads and in-place writes (`p.add_(1)`, `p.to_local().copy_(...)`, torch.nn.init) go through to "
            "this rank's shard; or read the full weights inside `with model.gathered_parameters() as module:`")


def _first_released(values):
    for value in values:
        if isinstance(value, ReleasedParameter):
            return value
        if isinstance(value, (list, tuple)):  # torch._foreach_* take lists of tensors
            found = _first_released(value)
            if found is not None:
                return found
    return None


class RestingParameters:
    """Swaps each group's parameters in every owning module between the real ones and their resting DTensors."""

    def __init__(self, groups, owners: Dict[int, List[Tuple[nn.Module, str]]], mesh_of):
        """`mesh_of(group)`: the mesh of the ranks `group` is sharded over (where its resting DTensors live)."""
        self._mesh_of = mesh_of
        self._groups = list(groups)
        self._resting: Dict[int, nn.Parameter] = {}
        for group in self._groups:
            for index, (param, name) in enumerate(zip(group.params, group.names)):
                self._resting[id(param)] = self._make_resting(group, index, param, name)
                setattr(param, NAME_ATTR, name)
        # id(real parameter) -> its class, restored when its group is gathered; a parameter of a class with a
        # torch function handler of its own (a tensor subclass) keeps it and is not guarded.
        self._classes = {id(param): type(param) for group in self._groups for param in group.params
                         if type(param).__torch_function__ is nn.Parameter.__torch_function__}
        self._hidden = set()  # ids of groups whose resting parameters are installed
        # id(group) -> [(owning module's parameter dict, attribute, real parameter, resting parameter)]
        self._slots = {id(group): [(module._parameters, attribute, param, self._resting[id(param)])
                                   for param in group.params for module, attribute in owners.get(id(param), ())]
                       for group in self._groups}

    def _make_resting(self, group, index: int, param: nn.Parameter, name: str) -> nn.Parameter:
        local = group.rows_of_shard(group.compute_shard, index)
        resting = dtensor_parameter(rows_dtensor(local, param, self._mesh_of(group)), param.requires_grad)
        resting.__dict__.update(param.__dict__)  # Megatron attributes (tensor_model_parallel, ...) stay visible
        resting.resting_name = name
        if param._backward_hooks is not None:  # `param.register_hook(fn)` before wrapping: one dict for both
            resting._backward_hooks = param._backward_hooks
        return resting

    def carry_gradient_hooks(self):
        """Before a forward: `register_hook(fn)` on a resting parameter (`p.register_hook` over `model.parameters()`
        between steps) acts on its real parameter, which the forward computes with. Both share one hook dict (so
        the handle's `remove()` works), and `fn` sees this rank's gradient of the whole parameter before it is
        reduced, as a hook registered before wrapping does. `register_post_accumulate_grad_hook` on a resting
        parameter is refused: the real parameters' post-accumulate hooks are Megatron-FSDP's own."""
        for group in self._groups:
            for param, name in zip(group.params, group.names):
                resting = self._resting[id(param)]
                if resting._post_accumulate_grad_hooks:
                    raise ValueError(
                        f"register_post_accumulate_grad_hook on parameter '{name}' of a Megatron-FSDP model "
                        "(zero_dp_strategy 3) would never run: the forward computes with the gathered weights, not "
                        "with the Shard(0) parameter the module shows between steps. Use register_hook(fn) (fn sees "
                        "this rank's gradient before reduction), or read p.grad after loss.backward()")
                hooks = resting._backward_hooks
                if not hooks:
                    continue
                with torch._C.DisableTorchFunctionSubclass():  # `param` may be a ReleasedParameter now
                    current = param._backward_hooks
                    if current is not hooks:
                        hooks.update(current or {})
                        param._backward_hooks = hooks

    def placeholders(self) -> Dict[int, nn.Parameter]:
        """id(real parameter) -> its resting parameter."""
        return dict(self._resting)

    def resting_of(self, param: nn.Parameter) -> nn.Parameter:
        return self._resting[id(param)]

    def hide(self, group):
        if id(group) in self._hidden:
            return
        for parameters, attribute, _, resting in self._slots[id(group)]:
            parameters[attribute] = resting
        for param in group.params:
            if id(param) in self._classes:
                param.__class__ = ReleasedParameter
        self._hidden.add(id(group))

    def show(self, group):
        if id(group) not in self._hidden:
            return
        for param in group.params:
            if id(param) in self._classes:
                param.__class__ = self._classes[id(param)]
        for parameters, attribute, real, _ in self._slots[id(group)]:
            parameters[attribute] = real
        self._hidden.discard(id(group))

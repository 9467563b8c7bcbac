"""Materialise a model built on the meta device, one FSDP unit at a time.

RNG contract: every rank must seed its default generator identically before wrapping. Modules that own
parameters are initialised by calling their `reset_parameters()` (or, lacking it, the private
`_reset_parameters()` that torch modules such as `nn.MultiheadAttention` use), children before parents, on the
target device's generator. That reproduces an eager build on that device when constructors create their
submodules in registration order and initialise their own parameters after them (the usual case; it is what
`nn.MultiheadAttention` does: its `out_proj` draws first, then its own reset zeroes `out_proj.bias`). A parameter shared by several modules keeps the values from
the first module that owns it; later owners still draw their random numbers (into scratch tensors) so the RNG
stream stays aligned. Meta buffers are allocated empty and must be filled by `reset_parameters()`.
"""

from typing import Dict, List

import torch
import torch.nn as nn

from .param_and_grad_buffer import ParamGroup


def _initialise_module(module: nn.Module, name: str, device: torch.device, initialised: set):
    for buffer_name, buffer in module._buffers.items():
        if buffer is not None and buffer.is_meta:
            module._buffers[buffer_name] = torch.empty_like(buffer, device=device)
    direct = [(n, p) for n, p in module._parameters.items() if p is not None]
    if not direct and not module._buffers:
        return
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    if not callable(reset):
        if direct:
            raise RuntimeError(
                f"module '{name}' ({type(module).__name__}) owns parameters but has no reset_parameters(); "
                "it cannot be initialised from the meta device (init_model_with_meta_device=True): give it a "
                "reset_parameters() that initialises its own parameters"
            )
        return
    # Parameters already initialised by an earlier owner get scratch stand-ins for this call.
    swapped = {}
    for param_name, param in direct:
        if id(param) in initialised:
            swapped[param_name] = param
            module._parameters[param_name] = nn.Parameter(torch.empty_like(param), param.requires_grad)
    with torch.no_grad():
        reset()
    for param_name, param in swapped.items():
        module._parameters[param_name] = param
    initialised.update(id(p) for _, p in direct)


def _children_first(module: nn.Module, prefix: str = "", seen=None):
    """(name, module) for every module under `module` once, each after all of its children."""
    seen = set() if seen is None else seen
    if id(module) in seen:
        return
    seen.add(id(module))
    for child_name, child in module._modules.items():
        if child is not None:
            yield from _children_first(child, f"{prefix}.{child_name}" if prefix else child_name, seen)
    yield prefix, module


def materialize_meta_model(root: nn.Module, units: List[nn.Module], unit_groups: Dict[int, List[ParamGroup]],
                           root_groups: List[ParamGroup], device: torch.device, release):
    """Initialise every module, children before parents; a unit's full weights exist only while it is being
    initialised, then each rank keeps its shard (`release` drops the gathered buffer under strategy 3)."""
    unit_of_module = {}
    for unit_index, unit in enumerate(units):
        for inner in unit.modules():
            unit_of_module[id(inner)] = unit_index
    for group in root_groups:
        group.allocate_compute()
    initialised, open_unit = set(), None

    def close_unit(unit_index):
        for group in unit_groups.get(unit_index, []):
            group.commit_compute_to_shards()
        release(unit_groups.get(unit_index, []))

    for name, module in _children_first(root):
        unit_index = unit_of_module.get(id(module))
        if unit_index != open_unit:
            if open_unit is not None:
                close_unit(open_unit)
            open_unit = unit_index
            for group in unit_groups.get(unit_index, []) if unit_index is not None else []:
                group.allocate_compute()
        _initialise_module(module, name, device, initialised)
    if open_unit is not None:
        close_unit(open_unit)
    for group in root_groups:
        group.commit_compute_to_shards()
    release(root_groups)

"""Materialise a model built on the meta device, one FSDP unit at a time.

RNG contract: every rank must seed its default generator identically before wrapping. Modules that own
parameters are initialised by calling their `reset_parameters()` in `named_modules()` order, on the target
device's generator, which reproduces an eager build on that device when the model's constructor creates its
submodules in registration order (the usual case). A parameter shared by several modules keeps the values from
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
    reset = getattr(module, "reset_parameters", None)
    if reset is None:
        if direct:
            raise RuntimeError(
                f"module '{name}' ({type(module).__name__}) owns parameters but has no reset_parameters(); "
                "it cannot be initialised from the meta device (init_model_with_meta_device=True)"
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


def materialize_meta_model(root: nn.Module, units: List[nn.Module], unit_groups: Dict[int, List[ParamGroup]],
                           root_groups: List[ParamGroup], device: torch.device, release):
    """Initialise every module in `named_modules()` order; a unit's full weights exist only while it is being
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

    for name, module in root.named_modules():
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

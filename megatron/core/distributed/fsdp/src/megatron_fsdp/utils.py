"""Small helpers with no better home: devices, autograd-phase queries, module and parameter bookkeeping."""

import os
from typing import Dict, Iterable, List, Tuple

import torch
import torch.nn as nn


def current_accelerator_device() -> torch.device:
    """The CUDA device of this process (LOCAL_RANK), the one place that touches torch.cuda."""
    if not torch.cuda.is_available():
        raise RuntimeError("an NCCL process group needs a CUDA device, but torch.cuda is not available")
    index = torch.cuda.current_device() if torch.cuda.is_initialized() else int(os.environ.get("LOCAL_RANK", 0))
    return torch.device("cuda", index)


def in_backward_pass() -> bool:
    """True while the autograd engine is running a backward (e.g. during activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


def queue_end_of_backward_callback(callback):
    """Run `callback` once the current backward pass has finished (call from inside an autograd hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def tensors_requiring_grad(value) -> List[torch.Tensor]:
    leaves, _ = torch.utils._pytree.tree_flatten(value)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.requires_grad]


def parameter_owners(module: nn.Module) -> Dict[int, List[Tuple[nn.Module, str]]]:
    """Every (module, attribute name) that holds each parameter, keyed by `id(param)` (tied params have several)."""
    owners: Dict[int, List[Tuple[nn.Module, str]]] = {}
    for submodule in module.modules():
        for name, param in submodule._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((submodule, name))
    return owners


def replace_parameter(owners: Iterable[Tuple[nn.Module, str]], new_param: nn.Parameter):
    for submodule, name in owners:
        submodule._parameters[name] = new_param


def resolve_module_classes(fsdp_unit_modules) -> Tuple[type, ...]:
    """Accept classes or dotted names ("torch.nn.TransformerEncoderLayer") for `fsdp_unit_modules`."""
    classes = []
    for entry in fsdp_unit_modules or ():
        if isinstance(entry, str):
            module_path, _, class_name = entry.rpartition(".")
            if not module_path:
                raise ValueError(f"fsdp_unit_modules entry {entry!r} must be a class or a dotted 'package.Class'")
            import importlib

            entry = getattr(importlib.import_module(module_path), class_name)
        if not isinstance(entry, type) or not issubclass(entry, nn.Module):
            raise TypeError(f"fsdp_unit_modules entries must be nn.Module subclasses, got {entry!r}")
        classes.append(entry)
    return tuple(classes)


def outermost_unit_modules(module: nn.Module, unit_classes: Tuple[type, ...]) -> List[nn.Module]:
    """Instances of `unit_classes` not nested inside another instance, in `named_modules()` order."""
    if not unit_classes:
        return []
    units, covered = [], set()
    for submodule in module.modules():
        if id(submodule) in covered:
            continue
        if isinstance(submodule, unit_classes) and submodule is not module:
            units.append(submodule)
            covered.update(id(inner) for inner in submodule.modules())
    return units


def tensor_bytes(tensor) -> int:
    if tensor is None:
        return 0
    return tensor.numel() * tensor.element_size()

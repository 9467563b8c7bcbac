"""Small helpers with no better home: devices, autograd-phase queries, module and parameter bookkeeping."""

import os
import sys
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn as nn


# Attribute naming the MegatronFSDP model that owns a module or parameter.
WRAPPED_ATTR = "_megatron_fsdp_wrapper"

# The device type each communication backend serves when a process group names a bare backend.
_BACKEND_DEVICE_TYPES = {"nccl": "cuda", "xccl": "xpu", "hccl": "npu", "gloo": "cpu", "mpi": "cpu"}


def accelerator_device_type() -> Optional[str]:
    """The type of this machine's accelerator ("cuda", "xpu", ...), or None on a CPU-only machine."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not accelerator.is_available():
        return None
    return accelerator.current_accelerator().type


def backends_by_device_type(backend: str) -> Dict[str, str]:
    """{device type: backend} of a process group's backend string: "cpu:gloo,cuda:nccl" names them per device
    type; a bare "nccl" or "gloo" serves the device type it is built for."""
    backends = {}
    for entry in str(backend).lower().split(","):
        device_type, _, name = entry.strip().rpartition(":")
        backends[device_type or _BACKEND_DEVICE_TYPES.get(name, "cpu")] = name
    return backends


def device_type_for_backend(backend: str) -> str:
    """Where a process group on `backend` should keep its tensors: on the accelerator when the backend has one
    for this machine's accelerator (so a "cpu:gloo,cuda:nccl" group on a GPU machine computes on the GPU), else
    on the CPU when the backend serves it."""
    backends = backends_by_device_type(backend)
    accelerator = accelerator_device_type()
    if accelerator is not None and accelerator in backends:
        return accelerator
    if "cpu" in backends:
        return "cpu"
    return next(iter(backends))  # an accelerator-only backend: current_accelerator_device says what is missing


def current_accelerator_device(device_type: str = "cuda") -> torch.device:
    """This process's accelerator device: LOCAL_RANK (one device per local rank, modulo the devices visible to
    the process) under a launcher that sets it, else the accelerator's current device."""
    if accelerator_device_type() != device_type:
        raise RuntimeError(f"the process group communicates on {device_type} devices, but this machine has no "
                           f"{device_type} accelerator; pass device= or use a process group on gloo")
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None:
        return torch.device(device_type, int(local_rank) % torch.accelerator.device_count())
    return torch.device(device_type, torch.accelerator.current_device_index())


def resolve_device(device=None, mesh_device_type: Optional[str] = None, backend: Optional[str] = None) -> torch.device:
    """The device Megatron-FSDP keeps its buffers on: `device=` when given, else the device mesh's device type,
    else the device type the data-parallel group's backend serves on this machine."""
    if device is not None:
        return torch.device(device)
    device_type = mesh_device_type or device_type_for_backend(backend or "gloo")
    if device_type == "cpu":
        return torch.device("cpu")
    return current_accelerator_device(device_type)


def in_backward_pass() -> bool:
    """True while the autograd engine is running a backward (e.g. during activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


def current_graph_task_id() -> int:
    """Id of the backward (graph task) running now; -1 outside any backward. A reentrant activation-checkpoint
    backward nested in the step's backward has an id of its own."""
    return torch._C._current_graph_task_id()


def queue_end_of_backward_callback(callback):
    """Run `callback` once the current backward pass has finished (call from inside an autograd hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def tensors_requiring_grad(value) -> List[torch.Tensor]:
    """The tensors in `value` (a tensor or any pytree of them) that require grad."""
    if isinstance(value, torch.Tensor):  # the common output of a module: no tree to walk
        return [value] if value.requires_grad else []
    leaves, _ = torch.utils._pytree.tree_flatten(value)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.requires_grad]


def register_first_grad_hook(tensors: List[torch.Tensor], callback: Callable[[], None]):
    """Run `callback()` once in each backward, when the first gradient of any of `tensors` (which require grad)
    has been computed: `torch.autograd.graph.register_multi_grad_hook(..., mode="any")`, or for one tensor its own
    gradient hook, which fires once per backward alike at a small part of the cost."""
    if len(tensors) == 1:
        def on_grad(grad):
            callback()

        return tensors[0].register_hook(on_grad)
    return torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: callback(), mode="any")


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
    """Accept classes or dotted names ("torch.nn.TransformerEncoderLayer") for `fsdp_unit_modules`: a sequence
    of them, or one."""
    if isinstance(fsdp_unit_modules, (str, type)):
        fsdp_unit_modules = [fsdp_unit_modules]
    classes = []
    for entry in fsdp_unit_modules or ():
        if isinstance(entry, str):
            module_path, _, class_name = entry.rpartition(".")
            if not module_path:
                raise ValueError(f"fsdp_unit_modules entry {entry!r} must be a class or a dotted 'package.Class'")
            import importlib

            try:
                entry = getattr(importlib.import_module(module_path), class_name)
            except (ImportError, AttributeError) as error:
                raise ValueError(f"fsdp_unit_modules entry {entry!r} names no importable class ({error}); give the "
                                 "class itself or its full dotted path, e.g. 'torch.nn.TransformerEncoderLayer'"
                                 ) from error
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


_EAGER_REASON = ("Megatron-FSDP's hooks gather, release and reduce parameters and run eagerly. With fullgraph=True, "
                 "compile each FSDP unit instead of the whole model: `torch.compile(block)` assigned back into the "
                 "model before wrapping, or `block.compile()` before or after")


def run_eagerly(fn):
    """`fn`, run outside torch.compile's graphs: compiled code that calls it breaks its graph there. Megatron-FSDP's
    hooks swap parameters, issue collectives and keep Python state, which dynamo would otherwise trace (and
    recompile for every group) or refuse under `fullgraph=True`."""
    try:
        return torch.compiler.disable(fn, recursive=True, reason=_EAGER_REASON)
    except TypeError:  # torch < 2.7: no reason=
        return torch.compiler.disable(fn, recursive=True)


def unit_call_module(root: nn.Module, unit: nn.Module) -> nn.Module:
    """The module whose call runs `unit` and nothing else: `unit` itself, or the outermost chain of wrappers
    around it, `torch.compile(unit)`'s OptimizedModule and `checkpoint_wrapper(unit)`. Hooks registered there
    run outside the compiled graph (a `fullgraph=True` unit compiles whole) and once per forward, not again in
    the activation-checkpoint recompute."""
    wrapper_of = {}
    for module in root.modules():
        inner = _wrapped_child(module)
        if inner is not None:
            wrapper_of[id(inner)] = module
    while id(unit) in wrapper_of and wrapper_of[id(unit)] is not root:
        unit = wrapper_of[id(unit)]
    return unit


def _wrapped_child(module: nn.Module) -> Optional[nn.Module]:
    """The module that `module` only wraps (a compiled or activation-checkpointed module), else None."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not loaded: nothing was compiled
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        return module._orig_mod
    inner = module._modules.get("_checkpoint_wrapped_module")  # torch's ActivationWrapper
    return inner if inner is not None and len(module._modules) == 1 else None


# The module whose helpers (get_model_state_dict, get_optimizer_state_dict, ...) name a model's tensors by their
# state-dict keys.
TORCH_STATE_DICT_HELPERS = "torch.distributed.checkpoint.state_dict"


def called_from_torch_state_dict_helpers(depth: int, through_module_methods: bool = False) -> bool:
    """Whether the function `depth` frames up from the caller of this one belongs to `TORCH_STATE_DICT_HELPERS`;
    with `through_module_methods`, the first one above it that is not an `nn.Module` method of torch's own (a
    helper's `model.named_parameters()` reaches a child's `named_modules` through `nn.Module`'s traversal)."""
    frame = sys._getframe(depth + 1)
    while through_module_methods and frame is not None and frame.f_globals.get("__name__") == nn.Module.__module__:
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__") == TORCH_STATE_DICT_HELPERS


def tensor_bytes(tensor) -> int:
    if tensor is None:
        return 0
    return tensor.numel() * tensor.element_size()


def __getattr__(name):
    """`megatron_fsdp.utils.FSDPDistributedIndex`, upstream's import path (loaded on use, as the package's names)."""
    if name == "FSDPDistributedIndex":
        from .distributed_index import FSDPDistributedIndex

        return FSDPDistributedIndex
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

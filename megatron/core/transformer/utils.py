"""Small helpers shared by the transformer modules and the models built from them."""

import torch

from megatron.core.device_utils import get_current_device
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker


def parameter_device(config) -> torch.device:
    """Where a module allocates its parameters: the meta device for deferred initialisation, the CPU when
    `use_cpu_initialization` asks for it, else this process's compute device."""
    if getattr(config, "init_model_with_meta_device", False) or torch.get_default_device().type == "meta":
        return torch.device("meta")
    if getattr(config, "use_cpu_initialization", False):
        return torch.device("cpu")
    return get_current_device()


def initialize_from_cpu_master(param: torch.nn.Parameter, init_method) -> None:
    """Fill `param` from an fp32 CPU tensor drawn by `init_method` from the default CPU generator.

    Drawing on the CPU, as the tensor-parallel layers do, makes the initial weights independent of the
    device and keeps every rank's generator in lockstep. Meta parameters are left for later materialisation.
    """
    if param.is_meta:
        return
    master = torch.empty(param.shape, dtype=torch.float32, device="cpu")
    init_method(master)
    with torch.no_grad():
        param.copy_(master.to(dtype=param.dtype))


def residual_dropout(dropout: torch.nn.Module, x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """`dropout(x)` on a layer's output before the residual add; under sequence parallelism the ranks hold
    different tokens, so each draws its own mask (the tensor-parallel RNG stream)."""
    if sequence_parallel:
        with get_cuda_rng_tracker().fork():
            return dropout(x)
    return dropout(x)


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """GeLU's tanh approximation, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) (`--openai-gelu`): the
    activation of the original GPT-2 code, kept for models trained with it."""
    return torch.nn.functional.gelu(x, approximate="tanh")


EXTRA_STATE_SUFFIX = "_extra_state"


def make_sharded_tensors_for_checkpoint(state_dict, prefix="", tensor_parallel_layers_axis_map=None,
                                        sharded_offsets=(), extra_state_suffix=EXTRA_STATE_SUFFIX):
    """A module's local `state_dict` as sharded checkpoint entries keyed `prefix + name`: the tensors named in
    `tensor_parallel_layers_axis_map` ({name: axis}) as this rank's tensor-parallel partition along that axis,
    the other tensors as replicated, and `*_extra_state` entries as the objects they are (saved as objects)."""
    from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

    axis_map = dict(tensor_parallel_layers_axis_map or {})
    unknown = sorted(set(axis_map) - set(state_dict))
    if unknown:
        raise ValueError(f"tensor_parallel_layers_axis_map names {unknown}, which are not in the state dict "
                         f"(keys: {sorted(state_dict)})")
    sharded = {}
    for name, value in state_dict.items():
        key = f"{prefix}{name}"
        if name.endswith(extra_state_suffix):
            sharded[key] = value
        elif not torch.is_tensor(value):
            raise TypeError(f"{key}: expected a tensor or an extra state, got {type(value).__name__}")
        elif name in axis_map:
            sharded[key] = make_tp_sharded_tensor_for_checkpoint(value, key, axis_map[name],
                                                                 prepend_offsets=sharded_offsets)
        else:
            sharded[key] = make_sharded_tensor_for_checkpoint(value, key, prepend_offsets=sharded_offsets)
    return sharded


def sharded_state_dict_default(module, prefix="", sharded_offsets=(), metadata=None):
    """`module.sharded_state_dict(...)` when the module defines one, else the default of `MegatronModule` (its
    own tensors, tensor-parallel ones as their partition, then its children's entries)."""
    if hasattr(module, "sharded_state_dict"):
        return module.sharded_state_dict(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)
    return module_sharded_state_dict(module, prefix, sharded_offsets, metadata)


def _overrides_extra_state(module) -> bool:
    return "get_extra_state" in module.__dict__ or type(module).get_extra_state is not torch.nn.Module.get_extra_state


def module_sharded_state_dict(module, prefix="", sharded_offsets=(), metadata=None):
    """The default sharded state of `module`: its own tensors (tensor-parallel ones as their partition), its
    extra state when it has one, then each child's `sharded_state_dict_default`."""
    from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

    entries = {}
    own = list(module.named_parameters(recurse=False)) + [
        (name, buffer) for name, buffer in module.named_buffers(recurse=False)
        if name not in module._non_persistent_buffers_set
    ]
    for name, tensor in own:
        if tensor is None:
            continue
        key = f"{prefix}{name}"
        if getattr(tensor, "tensor_model_parallel", False):
            entries[key] = make_tp_sharded_tensor_for_checkpoint(tensor, key, tensor.partition_dim,
                                                                 prepend_offsets=sharded_offsets)
        else:
            entries[key] = make_sharded_tensor_for_checkpoint(tensor, key, prepend_offsets=sharded_offsets)
    if _overrides_extra_state(module):
        entries[f"{prefix}{EXTRA_STATE_SUFFIX}"] = module.get_extra_state()
    for name, child in module.named_children():
        entries.update(sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata))
    return entries

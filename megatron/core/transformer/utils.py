"""Small helpers shared by the transformer modules and the models built from them."""

import torch

from megatron.core.device_utils import get_current_device


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

"""Which device this process computes on, and the only place that talks to `torch.cuda`.

The device follows the communication backend: a process group on NCCL computes on `cuda:LOCAL_RANK`,
one on gloo (or no process group at all) computes on the CPU. Everything else in the code base asks
these helpers instead of hard-coding a device, so the same code runs in CPU tests and on GPUs.
"""

import os

import torch
import torch.distributed as dist


def device_type_for_backend(backend):
    """"cuda" for NCCL (including mixed "cpu:gloo,cuda:nccl" backends), "cpu" otherwise."""
    return "cuda" if "nccl" in str(backend).lower() else "cpu"


def _cuda_device_for_this_process():
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def get_current_device():
    """`cuda:LOCAL_RANK` when the default process group uses NCCL, else the CPU."""
    if dist.is_available() and dist.is_initialized() and device_type_for_backend(dist.get_backend()) == "cuda":
        return _cuda_device_for_this_process()
    return torch.device("cpu")


def get_device_for_group(group=None):
    """The device whose tensors `group`'s collectives accept (the default group when None)."""
    if device_type_for_backend(dist.get_backend(group)) == "cuda":
        return _cuda_device_for_this_process()
    return torch.device("cpu")


def cuda_is_available():
    return torch.cuda.is_available()


def synchronize(device=None):
    """Wait for queued kernels on `device` (a no-op on the CPU)."""
    device = torch.device(device) if device is not None else get_current_device()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def get_rng_state(device):
    """State of `device`'s default random generator."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def set_rng_state(state, device):
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def manual_seed_device(seed, device):
    """Seed only `device`'s default generator (torch.manual_seed would seed every device)."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[index].manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


def memory_allocated(device=None):
    """Bytes held by tensors on a CUDA device; 0 on the CPU, which has no caching allocator to ask."""
    device = torch.device(device) if device is not None else get_current_device()
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def max_memory_allocated(device=None):
    device = torch.device(device) if device is not None else get_current_device()
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0

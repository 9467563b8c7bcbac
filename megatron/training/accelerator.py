"""The only place in the training driver that talks to `torch.cuda`: device choice and memory counters."""

import resource
import sys

import torch


def cuda_available():
    return torch.cuda.is_available()


def default_backend():
    return "nccl" if cuda_available() else "gloo"


def device_for_backend(backend, local_rank):
    """cuda:LOCAL_RANK for NCCL (and make it current), cpu for gloo."""
    if backend == "nccl":
        if not cuda_available():
            raise ValueError("--distributed-backend nccl needs a CUDA GPU and none is visible to this process: use "
                             "--distributed-backend gloo (the default without a GPU), or drop the flag")
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"local rank {local_rank} has no GPU of its own: this node shows "
                             f"{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES); launch at most that many ranks "
                             "per node (torchrun --nproc-per-node)")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def empty_cache(device):
    """Return the caching allocator's unused blocks to the device (GPU); the CPU allocator keeps no cache."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_memory_bytes(device):
    """Max allocated bytes on a GPU; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return int(max_rss if sys.platform == "darwin" else max_rss * 1024)


def allocated_memory_bytes(device):
    """Currently allocated bytes on a GPU; None on CPU (where the training log reports tensor bytes instead)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return None


def memory_counters_bytes(device):
    """{name: bytes} of this process's memory: on a GPU the caching allocator's allocated / max allocated /
    reserved / max reserved bytes (upstream's `report_memory` fields); on CPU the resident set size, current and
    peak (the current one where /proc tells it)."""
    if device.type == "cuda":
        return {"allocated": torch.cuda.memory_allocated(device),
                "max allocated": torch.cuda.max_memory_allocated(device),
                "reserved": torch.cuda.memory_reserved(device),
                "max reserved": torch.cuda.max_memory_reserved(device)}
    counters = {}
    try:
        with open("/proc/self/statm") as statm:
            counters["resident"] = int(statm.read().split()[1]) * resource.getpagesize()
    except OSError:
        pass
    counters["max resident"] = peak_memory_bytes(device)
    return counters

"""NCCL user buffers: Megatron-FSDP's buffers come from one memory pool that is registered with NCCL.

A registered buffer lets NCCL run a collective on it in place (zero-copy, fewer SMs) instead of staging it
through NCCL's own buffers. `MegatronFSDP(..., nccl_user_buffers=NcclUserBuffers(...))` asks for it; then
`buffer_allocator_for` picks how its buffers are allocated:

- `PooledBuffers` on a CUDA device whose data-parallel groups all run NCCL: a `torch.cuda.MemPool` backed by
  NCCL's allocator (`ncclMemAlloc`, the backend's `mem_allocator`) where the backend supports it, else by
  torch's CUDA allocator (a private pool, registered all the same; a warning says so). Buffers are allocated
  inside `torch.cuda.use_mem_pool(pool)` and the pool is registered with every group's NCCL backend
  (`ProcessGroupNCCL.register_mem_pool`, torch >= 2.7).
- `UnpooledBuffers` otherwise (no options, a CPU device, a gloo group): plain allocations, nothing registered.

Two kinds of allocation go through a `PooledBuffers`:
- `buffers()`: the persistent buffers of a parameter group (compute weights, shards, main weights, gradients)
  and the double-buffer pool, allocated while the model is wrapped, the same on every rank. By default the
  pool is registered again after each such block (the registration of the segments it had is dropped first,
  so each segment is registered once); with `manual_registration` nothing is registered while the buffers are
  built and `buffers_built()` registers the pool once, after all of them exist.
- `transient()`: the per-step allocations of collectives (the storage a ZeRO-3 group's compute buffer gets back
  for a gather, the gather staging buffer, the transient gradient buffer a reduce-scatter reads, the shard
  gradients it writes). They come from the pool, mostly reusing the registered segments the persistent
  buffers of the same sizes were freed into; nothing is registered during a step, since the ranks need not
  allocate alike there.

Registration is symmetric (NCCL window registration, `register_mem_pool(pool, symm=True)`) by default where
torch exposes it and the memory is NCCL's own; `symmetric=False` (`--disable-symmetric-registration`) registers
each rank's segments locally (`ncclCommRegister`). Window registration needs memory from `ncclMemAlloc`: with
the fallback pool on torch's allocator, and with a torch whose `register_mem_pool` takes no `symm`, local
registration is the only mode.

The NCCL communicator of a group must exist before a pool is registered with it: `PooledBuffers` issues a
one-element all-reduce on each group whose backend is not initialised yet before the first registration.
"""

import contextlib
import dataclasses
import warnings
from typing import Callable, List, Optional, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class NcclUserBuffers:
    """How Megatron-FSDP's buffers are registered with NCCL (upstream's flags in parentheses).

    `manual_registration` (`--fsdp-manual-registration`): register the pool once, after the wrapper built all
    its buffers, instead of after each group's allocation. `symmetric` (on unless
    `--disable-symmetric-registration`): NCCL window registration where available (see the module docstring).
    """

    manual_registration: bool = False
    symmetric: bool = True


class UnpooledBuffers:
    """Plain allocations, nothing registered: no NCCL user buffers were asked for, or this run cannot have them
    (`reason` says why)."""

    active = False

    def __init__(self, reason: str = "no NCCL user buffers requested"):
        self.reason = reason

    def buffers(self):
        return contextlib.nullcontext()

    def transient(self):
        return contextlib.nullcontext()

    def buffers_built(self):
        pass


class PooledBuffers:
    """Allocations routed to `pool` and the pool's registration with `backends` (see the module docstring).

    `use_pool()` returns the context that routes allocations to the pool (`torch.cuda.use_mem_pool(pool)`);
    `warm_up`, if given, runs once before the first registration (it creates the NCCL communicators).
    `registrations` counts registrations of the pool (each covers every backend); `registered` says whether the
    pool is registered now.
    """

    active = True

    def __init__(self, pool, backends: Sequence, use_pool: Callable[[], contextlib.AbstractContextManager], *,
                 manual_registration: bool, symmetric: bool, warm_up: Optional[Callable[[], None]] = None,
                 source: str = ""):
        self.pool = pool
        self.backends = list(backends)
        self._use_pool = use_pool
        self.manual_registration = manual_registration
        self.symmetric = symmetric
        self._warm_up = warm_up
        self.source = source
        self.registered = False
        self.registrations = 0

    @contextlib.contextmanager
    def buffers(self):
        """Persistent buffers: allocated from the pool, and (unless manual) the pool registered afterwards."""
        if self.registered and not self.manual_registration:
            self._deregister()
        with self._use_pool():
            yield
        if not self.manual_registration:
            self._register()

    def transient(self):
        """Per-step allocations of collectives: from the pool, registered or not as its segments are."""
        return self._use_pool()

    def buffers_built(self):
        """Every persistent buffer exists: with manual registration, register the pool now (once)."""
        if self.manual_registration and not self.registered:
            self._register()

    def _register(self):
        if self._warm_up is not None:
            self._warm_up()
            self._warm_up = None
        for backend in self.backends:
            if self.symmetric:
                backend.register_mem_pool(self.pool, symm=True)
            else:
                backend.register_mem_pool(self.pool)
        self.registered = True
        self.registrations += 1

    def _deregister(self):
        for backend in self.backends:
            backend.deregister_mem_pool(self.pool)
        self.registered = False


def nccl_backend(group, device: torch.device):
    """The NCCL backend object of `group` on `device`, or None if the group runs another backend there."""
    try:
        backend = group._get_backend(device)
    except (RuntimeError, AttributeError, ValueError):
        return None
    return backend if type(backend).__name__ == "ProcessGroupNCCL" else None


def _missing_api(backends) -> List[str]:
    missing = [name for name in ("MemPool", "use_mem_pool") if not hasattr(torch.cuda, name)]
    for backend in backends:
        missing += [f"ProcessGroupNCCL.{name}" for name in ("register_mem_pool", "deregister_mem_pool")
                    if not hasattr(backend, name)]
    return sorted(set(missing))


def symmetric_registration_supported(backend) -> bool:
    """Whether this torch's `register_mem_pool` takes `symm` (window registration; torch >= 2.8)."""
    doc = getattr(type(backend).register_mem_pool, "__doc__", None) or ""
    return "symm" in doc


def _nccl_allocator(backend, device):
    """NCCL's allocator for a MemPool where the backend can allocate (`supports_tensor_alloc`), else None."""
    supports = getattr(backend, "supports_tensor_alloc", None)
    if supports is None or not hasattr(type(backend), "mem_allocator") or not supports(device):
        return None
    try:
        return backend.mem_allocator
    except RuntimeError:  # the property raises where NCCL cannot allocate (no ncclMemAlloc support)
        return None


def _warm_up_groups(groups, device):
    """Create each group's NCCL communicator (registration needs it): one all-reduce on groups not yet up."""
    import torch.distributed as dist

    for group in groups:
        backend = group._get_backend(device)
        is_initialized = getattr(backend, "_is_initialized", None)
        if is_initialized is None or not is_initialized():
            dist.all_reduce(torch.zeros(1, device=device), group=group)


def buffer_allocator_for(options: Optional[NcclUserBuffers], groups: Sequence, device: torch.device):
    """How a Megatron-FSDP wrapper over the process `groups` (its data-parallel groups, None entries skipped)
    on `device` allocates its buffers: `PooledBuffers` with NCCL user buffers, else `UnpooledBuffers`."""
    if options is None:
        return UnpooledBuffers()
    device = torch.device(device)
    if device.type != "cuda":
        return UnpooledBuffers(f"NCCL user buffers need a CUDA device; this wrapper runs on {device.type}")
    groups = list({id(group): group for group in groups if group is not None}.values())
    backends = [nccl_backend(group, device) for group in groups]
    if not backends or any(backend is None for backend in backends):
        return UnpooledBuffers("NCCL user buffers need every data-parallel group to run NCCL")
    missing = _missing_api(backends)
    if missing:
        raise RuntimeError(
            f"NCCL user buffers (--use-nccl-ub) need torch's NCCL memory-pool API (torch >= 2.7); torch "
            f"{torch.__version__} lacks {', '.join(missing)}: drop --use-nccl-ub or use a newer torch")
    allocator = _nccl_allocator(backends[0], device)
    symmetric = options.symmetric and symmetric_registration_supported(backends[0])
    if allocator is not None:
        pool, source = torch.cuda.MemPool(allocator), "NCCL's allocator (ncclMemAlloc)"
    else:
        pool, source = torch.cuda.MemPool(), "torch's CUDA allocator (private pool)"
        symmetric = False
        warnings.warn(
            f"NCCL user buffers: NCCL's allocator (ncclMemAlloc) is not supported on {device} (e.g. no CUDA "
            "multicast); Megatron-FSDP's buffers come from a private pool of torch's CUDA allocator, registered "
            "with NCCL locally (window registration needs NCCL-allocated memory)", stacklevel=2)
    return PooledBuffers(pool, backends, lambda: torch.cuda.use_mem_pool(pool, device),
                         manual_registration=options.manual_registration, symmetric=symmetric,
                         warm_up=lambda: _warm_up_groups(groups, device), source=source)

"""Counts the bytes that pass through torch.distributed collectives in this process.

`install()` replaces the collective functions on both `torch.distributed` and `torch.distributed.distributed_c10d`
with counting wrappers. It must run before the code under test is imported, so that a library which binds a
function at import time (`from torch.distributed import all_gather_into_tensor`) binds the wrapper; `dist.P2POp`
also accepts only the `isend`/`irecv` that torch.distributed holds at the time. Nested calls
(`all_gather_into_tensor` forwards to `all_gather_single`, `send` to `isend`) are counted once, at the outermost call.

Point-to-point sends (`isend`, `send`) are counted by the sender as kind "point_to_point", payload = the bytes of
the sent tensor; receives are not traffic of the receiving rank and are not counted. Every call also adds its
volume (`bench_theory.volume_bytes`, which for a send depends on the size of its group) to `volume_bytes`.

torch DDP's reducer calls the process group from C++, which no Python wrapper sees; the benchmark therefore
registers DDP's stock all-reduce communication hook, which issues the same all-reduce through `dist.all_reduce`.
"""

import contextlib
import functools
import inspect
import threading

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from examples.megatron_fsdp import bench_theory


def _payload_bytes(value):
    if isinstance(value, (list, tuple)):
        return sum(t.numel() * t.element_size() for t in value)
    return value.numel() * value.element_size()


def _self_split_bytes(arguments, group):
    """An all-to-all whose input leaves out this rank's own split (split size 0 for itself, the rank keeps that
    piece locally) still stands for the whole logical tensor: count the kept piece too, sized like the others."""
    splits = arguments.get("input_split_sizes")
    if not splits:
        return 0
    own = splits[dist.get_rank(group)]
    others = [size for index, size in enumerate(splits) if index != dist.get_rank(group)]
    if own != 0 or not others:
        return 0
    tensor = arguments["input"]
    row_bytes = tensor[0].numel() * tensor.element_size() if tensor.dim() > 0 and tensor.shape[0] else 0
    return max(others) * row_bytes


# name -> (collective kind, the argument whose size is the payload). The payload is the size of the whole
# logical tensor: the gathered output, the reduce-scatter input, the all-reduced tensor; for a point-to-point
# send, the sent tensor.
_PAYLOAD_ARGUMENT = {
    "all_reduce": ("all_reduce", "tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "all_to_all_single": ("all_to_all", "input"),
    "all_to_all": ("all_to_all", "input_tensor_list"),
    "broadcast": ("broadcast", "tensor"),
    "reduce": ("reduce", "tensor"),
    "isend": (bench_theory.POINT_TO_POINT, "tensor"),
    "send": (bench_theory.POINT_TO_POINT, "tensor"),
}


class CollectiveCounter:
    """Per-kind call counts and payload bytes, with the wire bytes and volume they add up to, recorded only while
    `counting()` is active."""

    def __init__(self):
        self._local = threading.local()
        self.enabled = False
        self.reset()

    def reset(self):
        self.calls = {}
        self.payload_bytes = {}
        self.wire_bytes = 0.0
        self.volume_bytes = 0.0

    @contextlib.contextmanager
    def counting(self):
        self.enabled = True
        try:
            yield self
        finally:
            self.enabled = False

    def record(self, kind, payload, group_size):
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.payload_bytes[kind] = self.payload_bytes.get(kind, 0) + payload
        self.wire_bytes += bench_theory.wire_bytes_per_rank(kind, payload, group_size)
        self.volume_bytes += bench_theory.volume_bytes(kind, payload, group_size)

    def wrap(self, name, function):
        kind, payload_argument = _PAYLOAD_ARGUMENT[name]
        signature = inspect.signature(function)

        @functools.wraps(function)
        def counted(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if self.enabled and depth == 0:
                arguments = signature.bind(*args, **kwargs).arguments
                group_size = dist.get_world_size(arguments.get("group"))
                payload = _payload_bytes(arguments[payload_argument])
                if name == "all_to_all_single":
                    payload += _self_split_bytes(arguments, arguments.get("group"))
                self.record(kind, payload, group_size)
            self._local.depth = depth + 1
            try:
                return function(*args, **kwargs)
            finally:
                self._local.depth = depth

        counted.__wrapped_collective__ = function
        return counted

    def snapshot(self):
        return {
            "calls": dict(self.calls),
            "payload_bytes": dict(self.payload_bytes),
            "wire_bytes": self.wire_bytes,
            "volume_bytes": self.volume_bytes,
        }


COUNTER = CollectiveCounter()


def install():
    """Wrap every known collective once; later calls are no-ops. Returns the process-wide counter."""
    for name in _PAYLOAD_ARGUMENT:
        original = getattr(c10d, name, None)
        if original is None or hasattr(original, "__wrapped_collective__"):
            continue
        counted = COUNTER.wrap(name, original)
        setattr(c10d, name, counted)
        if getattr(dist, name, None) is original:
            setattr(dist, name, counted)
    return COUNTER


def uninstall():
    """Put the original collectives back (for tests that share a process with other code)."""
    for name in _PAYLOAD_ARGUMENT:
        for module in (c10d, dist):
            function = getattr(module, name, None)
            if function is not None and hasattr(function, "__wrapped_collective__"):
                setattr(module, name, function.__wrapped_collective__)


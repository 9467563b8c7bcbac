"""The only module that calls torch.distributed: gathers, reductions, their async handles and byte counters.

Implementations are chosen per backend. gloo's own `reduce_scatter_tensor` is slow on CPU, so there a
reduce-scatter is an `all_to_all_single` (each rank receives every rank's copy of its own shard) followed by a
local sum. gloo has no PREMUL_SUM and must never see the coalescing manager, so neither is used anywhere.

Bytes are counted as what one rank *sends* with ring algorithms: an all-gather of an `n`-byte shard sends
`n * (world - 1)`, a reduce-scatter of an `N`-byte buffer sends `N * (world - 1) / world`, an all-reduce twice that.
"""

from collections import defaultdict
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_REDUCE = "all_reduce"
BROADCAST = "broadcast"

# Newer torch names the flat all-gather `all_gather_single` and deprecates `all_gather_into_tensor`.
_ALL_GATHER_INTO_FLAT = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CommunicationCounter:
    """Bytes sent by this rank, per collective kind, since the last reset."""

    def __init__(self):
        self.bytes_sent: Dict[str, int] = defaultdict(int)
        self.calls: Dict[str, int] = defaultdict(int)

    def record(self, kind: str, num_bytes: float):
        self.bytes_sent[kind] += int(round(num_bytes))
        self.calls[kind] += 1

    def reset(self):
        self.bytes_sent.clear()
        self.calls.clear()

    def snapshot(self) -> Dict[str, int]:
        return {kind: self.bytes_sent.get(kind, 0) for kind in (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, BROADCAST)}


class PendingCollective:
    """An in-flight collective; `wait()` blocks on it and then runs the local epilogue (e.g. the shard sum)."""

    def __init__(self, work=None, epilogue: Optional[Callable[[], None]] = None):
        self._work = work
        self._epilogue = epilogue
        self.done = False

    def wait(self):
        if self.done:
            return
        if self._work is not None:
            self._work.wait()
        if self._epilogue is not None:
            self._epilogue()
        self.done = True
        self._work = self._epilogue = None


def backend_of(group) -> str:
    return str(dist.get_backend(group)).lower()


def group_size(group) -> int:
    return dist.get_world_size(group)


def group_rank(group) -> int:
    return dist.get_rank(group)


def default_world_size() -> int:
    return dist.get_world_size()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _finish(work, epilogue, async_op) -> PendingCollective:
    pending = PendingCollective(work, epilogue)
    if not async_op:
        pending.wait()
    return pending


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group, counter: CommunicationCounter,
                    async_op: bool = False) -> PendingCollective:
    """Gather every rank's `shard` into the flat `output` (rank order)."""
    world = group_size(group)
    if world == 1:
        if output.data_ptr() != shard.data_ptr():
            output.copy_(shard)
        return PendingCollective()
    counter.record(ALL_GATHER, shard.numel() * shard.element_size() * (world - 1))
    work = _ALL_GATHER_INTO_FLAT(output, shard, group=group, async_op=async_op)
    return _finish(work, None, async_op)


def reduce_scatter_flat(output: torch.Tensor, flat_input: torch.Tensor, group, counter: CommunicationCounter,
                        average: bool = False, accumulate: bool = False, async_op: bool = False) -> PendingCollective:
    """Sum (or average) `flat_input` over ranks and leave this rank's shard in `output`.

    `accumulate=True` adds the result into `output` instead of overwriting it. `output` may have a different
    dtype than `flat_input` (the result is cast on the way in).
    """
    world = group_size(group)
    shard_numel = flat_input.numel() // world
    if world > 1:
        counter.record(REDUCE_SCATTER, flat_input.numel() * flat_input.element_size() * (world - 1) / world)
    if world == 1:
        result = flat_input
    elif backend_of(group) == "gloo":
        received, work, own_shard = _all_to_all_shards(flat_input, shard_numel, group, world, async_op)

        def sum_received():
            summed = received.view(-1, shard_numel).sum(dim=0)
            if own_shard is not None:
                summed.add_(own_shard)
            _store(output, summed.div_(world) if average else summed, accumulate)

        return _finish(work, sum_received, async_op)
    else:
        direct = not accumulate and output.dtype == flat_input.dtype
        result = output if direct else flat_input.new_empty(shard_numel)
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        work = dist.reduce_scatter_tensor(result, flat_input, op=op, group=group, async_op=async_op)
        if direct:
            return _finish(work, None, async_op)
        return _finish(work, lambda: _store(output, result, accumulate), async_op)
    return _finish(None, lambda: _store(output, result.div(world) if average else result, accumulate), False)


def _all_to_all_shards(flat_input: torch.Tensor, shard_numel: int, group, world: int, async_op: bool):
    """Send every rank its shard of `flat_input`; returns (received shards, work, own shard kept locally).

    When this rank's own shard is at either end of the input (always with two ranks) it is not sent to itself,
    so the receive buffer holds `world - 1` shards instead of a second full-size copy of the input.
    """
    rank = group_rank(group)
    if rank not in (0, world - 1):
        received = torch.empty_like(flat_input)
        return received, dist.all_to_all_single(received, flat_input, group=group, async_op=async_op), None
    own_start = rank * shard_numel
    own_shard = flat_input[own_start:own_start + shard_numel]
    others = flat_input[shard_numel:] if rank == 0 else flat_input[:own_start]
    received = flat_input.new_empty((world - 1) * shard_numel)
    sizes = [0 if peer == rank else shard_numel for peer in range(world)]
    work = dist.all_to_all_single(received, others, output_split_sizes=sizes, input_split_sizes=sizes,
                                  group=group, async_op=async_op)
    return received, work, own_shard


def _store(output: torch.Tensor, value: torch.Tensor, accumulate: bool):
    if accumulate:
        output.add_(value)
    elif output.data_ptr() != value.data_ptr():
        output.copy_(value)


def all_reduce(tensor: torch.Tensor, group, counter: CommunicationCounter, average: bool = False,
               async_op: bool = False) -> PendingCollective:
    """In-place sum (or average) of `tensor` over the group."""
    world = group_size(group)
    if world == 1:
        return PendingCollective()
    counter.record(ALL_REDUCE, 2 * tensor.numel() * tensor.element_size() * (world - 1) / world)
    gloo = backend_of(group) == "gloo"
    op = dist.ReduceOp.SUM if (gloo or not average) else dist.ReduceOp.AVG
    work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    epilogue = (lambda: tensor.div_(world)) if (average and gloo) else None
    return _finish(work, epilogue, async_op)


def all_reduce_scalar_sum(value: torch.Tensor, group) -> torch.Tensor:
    """Sum of a small tensor over the group (used for norms and checks; not counted as training traffic)."""
    if group_size(group) > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


def all_reduce_max(value: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value


def broadcast(tensor: torch.Tensor, group, counter: CommunicationCounter, src_group_rank: int = 0):
    world = group_size(group)
    if world == 1:
        return
    counter.record(BROADCAST, tensor.numel() * tensor.element_size())
    dist.broadcast(tensor, group=group, group_src=src_group_rank)


def all_gather_objects(obj, group) -> list:
    gathered = [None] * group_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def device_for_group(group) -> torch.device:
    """cuda (current device) for NCCL groups, cpu otherwise."""
    if backend_of(group) == "nccl":
        from .utils import current_accelerator_device

        return current_accelerator_device()
    return torch.device("cpu")

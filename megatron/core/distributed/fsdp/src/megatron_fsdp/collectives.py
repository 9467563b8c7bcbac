"""The only module that calls torch.distributed: gathers, reductions, their async handles and byte counters.

Implementations are chosen per backend. On gloo the stock all-gather and reduce-scatter take more than twice the
CPU time of exchanging the shards directly, so there both are built from point-to-point `isend`/`irecv` pairs:
an all-gather sends this rank's shard to every peer and receives theirs into the flat output in place; a
reduce-scatter sends every peer its shard of the input and sums what arrives for this rank's own shard. Each
rank sends exactly what a ring algorithm sends, `(world - 1) / world` of the gathered or reduced buffer. All
ranks post the same operations in the same order, so the messages of concurrent collectives on one group
match in order. gloo has no PREMUL_SUM and must never see the coalescing manager, so neither is used anywhere.

Posting a gloo message can block: `isend`/`irecv` take the pair's lock, which gloo's transport thread holds
while it reads an incoming message, so a main thread that posts the next unit's gather while the previous one
is arriving stalls for the length of that read. The messages are therefore posted from one background thread
(`post_in_background`), first in first out, so each process still posts in its program order and messages still
match; the caller gets a handle at once and goes on computing, and waiting on gloo work releases the GIL. The
messages carry a tag of their own (`MESSAGE_TAG`), so messages that other code exchanges on the same group from
the main thread are never matched with them.

Bytes are counted as what one rank *sends* with ring algorithms: an all-gather of an `n`-byte shard sends
`n * (world - 1)`, a reduce-scatter of an `N`-byte buffer sends `N * (world - 1) / world`, an all-reduce twice that.
"""

import atexit
import os
import queue
import threading
import time
from collections import defaultdict
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from .utils import backends_by_device_type, resolve_device

ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_REDUCE = "all_reduce"
BROADCAST = "broadcast"

# Newer torch names the flat collectives `*_single` and deprecates the `*_tensor` names.
_ALL_GATHER_INTO_FLAT = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_FROM_FLAT = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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


class _Posting:
    """Work handles that the posting thread will produce (see `post_in_background`)."""

    def __init__(self):
        self.event = threading.Event()
        self.works = []
        self.error = None

    def wait_posted(self) -> list:
        self.event.wait()
        if self.error is not None:
            raise self.error
        return self.works


class _PostingThread:
    """One FIFO thread that posts every point-to-point message of this process, in submission order."""

    def __init__(self):
        self.queue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="megatron-fsdp-p2p-posting", daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            post, posting = self.queue.get()
            try:
                posting.works = post()
            except BaseException as error:  # handed to whoever waits for it
                posting.error = error
            event = posting.event
            post = posting = None  # drop the buffers before the waiter wakes: this thread keeps none of them alive
            event.set()

    def submit(self, post) -> _Posting:
        posting = _Posting()
        self.queue.put((post, posting))
        return posting


_POSTING_THREAD = None
# The tag of every point-to-point message posted here. The group may be one that other code exchanges messages
# on too (context parallelism's ring on a dp-cp group with dp 1, a user's own sends on the world group), from the
# main thread and so in another order than the posting thread's: a tag of its own keeps the two streams apart.
MESSAGE_TAG = 0x46534450


def _forget_posting_thread():
    """A forked child has no posting thread (only the forking thread survives a fork): it starts its own."""
    global _POSTING_THREAD
    _POSTING_THREAD = None


os.register_at_fork(after_in_child=_forget_posting_thread)


def post_in_background(post: Callable[[], list]) -> list:
    """Run `post` (which posts point-to-point messages and returns their work handles) on the posting thread.
    Returns a one-element work list that `PendingCollective.wait` resolves to the handles."""
    global _POSTING_THREAD
    if _POSTING_THREAD is None:
        _POSTING_THREAD = _PostingThread()
    return [_POSTING_THREAD.submit(post)]


def _post_messages(group, receives: list, sends: list) -> list:
    """Post `(tensor, source)` receives, then `(tensor, target)` sends, on `group` under `MESSAGE_TAG`, from the
    posting thread. Returns the work list for `PendingCollective`."""
    # Through torch.distributed's functions, not the process group's own send/recv (a third cheaper to post):
    # tools that count traffic by wrapping torch.distributed (examples/megatron_fsdp/comm_counter.py) see them.
    def post():
        works = [dist.irecv(tensor, group=group, group_src=source, tag=MESSAGE_TAG) for tensor, source in receives]
        works += [dist.isend(tensor, group=group, group_dst=target, tag=MESSAGE_TAG) for tensor, target in sends]
        return works

    return post_in_background(post)


class PendingCollective:
    """An in-flight collective; `wait()` blocks on it (one work handle or a list of them) and then runs the local
    epilogue (e.g. the shard sum)."""

    def __init__(self, work=None, epilogue: Optional[Callable[[], None]] = None):
        self._works = list(work) if isinstance(work, (list, tuple)) else ([] if work is None else [work])
        self._epilogue = epilogue
        self.done = False
        self.staging_bytes = 0  # buffers the collective holds until it is waited for, if it allocated any

    def wait(self):
        if self.done:
            return
        if len(self._works) == 1 and isinstance(self._works[0], _Posting):
            self._works = self._works[0].wait_posted()
        for work in self._works:
            work.wait()
        if self._epilogue is not None:
            self._epilogue()
        self.done = True
        self._works = []
        self._epilogue = None
        self.staging_bytes = 0


# Build gloo all-gathers and reduce-scatters from point-to-point messages (see the module docstring). Tests set
# this to False to run the stock-collective code path, the one NCCL takes, on gloo.
GLOO_POINT_TO_POINT = True

_BACKEND_CACHE: Dict[object, Dict[str, str]] = {}


def backend_of(group) -> str:
    return str(dist.get_backend(group)).lower()


def backend_for(group, device: torch.device) -> str:
    """The backend `group` uses for tensors on `device` ("cpu:gloo,cuda:nccl" picks one per device type)."""
    backends = _BACKEND_CACHE.get(group)
    if backends is None:
        backends = _BACKEND_CACHE[group] = backends_by_device_type(backend_of(group))
    return backends.get(device.type) or next(iter(backends.values()))


def _point_to_point(group, tensor: torch.Tensor) -> bool:
    return GLOO_POINT_TO_POINT and backend_for(group, tensor.device) == "gloo"


def group_size(group) -> int:
    return dist.get_world_size(group)


def group_rank(group) -> int:
    return dist.get_rank(group)


def group_ranks(group) -> list:
    """Global ranks of `group`, in group-rank order."""
    return list(dist.get_process_group_ranks(group))


def default_world_size() -> int:
    return dist.get_world_size()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


# A gloo worker thread drops the tensors of the collective it has just run, after the waiter has been woken, and
# dropping a tensor that has a Python object takes the GIL. A script that ends right after a collective (the
# `full_tensor()` of a state-dict entry, a loss all-reduce) without `dist.destroy_process_group()` can reach
# interpreter finalization before that worker gets the GIL; CPython then ends the worker inside torch's noexcept
# work destructor and the process aborts ("terminate called without an active exception", SIGABRT) although
# every collective completed. Python runs atexit functions before it starts finalizing, so releasing the GIL
# there for a moment lets such workers finish first. Collectives never waited for may still be running then:
# those are not covered, and destroy_process_group() stays the clean way to end.
GLOO_WORKERS_AT_EXIT_S = 0.02


def _gloo_in_use() -> bool:
    if not is_initialized():
        return False
    backends = [backend_of(None)] + [backend for cached in _BACKEND_CACHE.values() for backend in cached.values()]
    return any("gloo" in backend for backend in backends)


def _let_gloo_workers_finish():
    """At exit, while process groups are still alive: release the GIL long enough for gloo workers to finish."""
    if _gloo_in_use():
        time.sleep(GLOO_WORKERS_AT_EXIT_S)


atexit.register(_let_gloo_workers_finish)


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
    if _point_to_point(group, shard):
        return _finish(_exchange_shards_for_gather(output, shard, group, world), None, async_op)
    work = _ALL_GATHER_INTO_FLAT(output, shard, group=group, async_op=async_op)
    return _finish(work, None, async_op)


# Pieces smaller than this travel packed into one message per peer (and are copied out of it when the gather is
# waited for): gloo spends tens of microseconds per message, more than copying a few KiB costs.
PACKED_PIECE_BYTES = 64 * 1024


def all_gather_pieces_in_place(outputs_by_rank: list, own_pieces: list, group, counter: CommunicationCounter,
                               async_op: bool = False) -> PendingCollective:
    """An all-gather whose shards are made of pieces that land apart from each other (gloo only, from
    point-to-point messages): rank r's shard is `outputs_by_rank[r]`, a list of views, and this rank sends
    `own_pieces` (the same sizes). Each piece of at least `PACKED_PIECE_BYTES` is received straight into its
    view (no staging, no copy-out); the smaller ones travel end to end in one message per peer and are copied
    into their views when the gather is waited for. Own pieces are copied into place unless they already are
    `outputs_by_rank[rank]`. The returned handle's `staging_bytes` counts the packed buffers."""
    world, rank = group_size(group), group_rank(group)
    shard_bytes = sum(piece.numel() * piece.element_size() for piece in own_pieces)
    if world > 1:
        counter.record(ALL_GATHER, shard_bytes * (world - 1))
    packed = [i for i, piece in enumerate(own_pieces) if piece.numel() * piece.element_size() < PACKED_PIECE_BYTES]
    if len(packed) < 2:  # packing a single piece would only add a copy
        packed = []
    packed_set = set(packed)
    direct = [i for i in range(len(own_pieces)) if i not in packed_set]
    packed_sizes = [own_pieces[i].numel() for i in packed]
    received = {}
    for _, source in _peers_in_ring_order(rank, world):
        if packed:
            received[source] = own_pieces[packed[0]].new_empty(sum(packed_sizes))
    sent = torch.cat([own_pieces[i] for i in packed]) if packed and world > 1 else None

    receives, sends = [], []
    for target, source in _peers_in_ring_order(rank, world):
        receives += [(outputs_by_rank[source][i], source) for i in direct]
        sends += [(own_pieces[i], target) for i in direct]
        if packed:
            receives.append((received[source], source))
            sends.append((sent, target))
    # Own pieces into place first, in one call: copying them after the hand-over would contend with the posting
    # thread for the GIL at every piece.
    moved = [(view, piece) for view, piece in zip(outputs_by_rank[rank], own_pieces)
             if view.data_ptr() != piece.data_ptr()]
    if moved:
        torch._foreach_copy_([view for view, _ in moved], [piece for _, piece in moved])
    works = _post_messages(group, receives, sends) if world > 1 else []

    def unpack():
        for source, buffer in received.items():
            torch.split_with_sizes_copy(buffer, packed_sizes, out=[outputs_by_rank[source][i] for i in packed])
        received.clear()

    pending = _finish(works, unpack if packed else None, async_op=True)
    pending.staging_bytes = sum(buffer.numel() * buffer.element_size() for buffer in received.values()) + (
        sent.numel() * sent.element_size() if sent is not None else 0)
    if not async_op:
        pending.wait()
    return pending


def gathers_in_place(group, tensor: torch.Tensor) -> bool:
    """Whether all-gathers over `group` are built from point-to-point messages that can land piece by piece."""
    return group_size(group) > 1 and _point_to_point(group, tensor)


def _peers_in_ring_order(rank: int, world: int):
    """(send-to, receive-from) pairs starting with the neighbours, so that no rank is every rank's first target."""
    return [((rank + step) % world, (rank - step) % world) for step in range(1, world)]


def _exchange_shards_for_gather(output: torch.Tensor, shard: torch.Tensor, group, world: int) -> list:
    """Post the point-to-point messages of an all-gather: receive each peer's shard into its slice of `output`,
    send our shard to each peer, and copy our own shard into place. Returns the work handles."""
    rank, numel = group_rank(group), shard.numel()
    peers = _peers_in_ring_order(rank, world)
    own_slice = output[rank * numel:(rank + 1) * numel]
    if own_slice.data_ptr() != shard.data_ptr():  # before the hand-over (see all_gather_pieces_in_place)
        own_slice.copy_(shard)
    return _post_messages(group, [(output[source * numel:(source + 1) * numel], source) for _, source in peers],
                          [(shard, target) for target, _ in peers])


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
    elif _point_to_point(group, flat_input):
        received, works = _exchange_shards_for_reduction(flat_input, shard_numel, group, world)
        own_shard = flat_input[group_rank(group) * shard_numel:(group_rank(group) + 1) * shard_numel]

        def sum_received():
            summed = received.view(world - 1, shard_numel).sum(dim=0) if world > 2 else received
            summed.add_(own_shard)
            _store(output, summed.div_(world) if average else summed, accumulate)

        return _finish(works, sum_received, async_op)
    else:
        direct = not accumulate and output.dtype == flat_input.dtype
        result = output if direct else flat_input.new_empty(shard_numel)
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        work = _REDUCE_SCATTER_FROM_FLAT(result, flat_input, op=op, group=group, async_op=async_op)
        if direct:
            return _finish(work, None, async_op)
        return _finish(work, lambda: _store(output, result, accumulate), async_op)
    return _finish(None, lambda: _store(output, result.div(world) if average else result, accumulate), False)


def reduce_scatter_coalesced(outputs: list, flat_inputs: list, group, counter: CommunicationCounter,
                             average: bool = False, accumulate: bool = False,
                             async_op: bool = False) -> PendingCollective:
    """Several `reduce_scatter_flat`s over one group (rank-major flat inputs of one dtype, each a multiple of the
    world size long) as one exchange: each rank's shards of all inputs are laid end to end (one copy of the
    inputs), reduced together, and each output gets its own part. From point-to-point messages every element is
    summed (and averaged) as its own reduce-scatter sums it, so the results are bit-identical; a stock collective
    sums as its backend does for the longer buffer. What is saved is the per-exchange cost (posting, the messages,
    the wait), which on gloo outweighs the copy for small buffers."""
    world = group_size(group)
    if world == 1 or len(flat_inputs) == 1:
        pendings = [reduce_scatter_flat(output, flat_input, group, counter, average=average, accumulate=accumulate,
                                        async_op=True) for output, flat_input in zip(outputs, flat_inputs)]
        return _finish(None, lambda: [pending.wait() for pending in pendings], async_op)
    shard_numels = [flat_input.numel() // world for flat_input in flat_inputs]
    rows = torch.cat([flat_input.view(world, numel) for flat_input, numel in zip(flat_inputs, shard_numels)], dim=1)
    shard_numel = rows.shape[1]
    counter.record(REDUCE_SCATTER, rows.numel() * rows.element_size() * (world - 1) / world)

    def store_parts(summed: torch.Tensor):
        for output, part in zip(outputs, summed.split(shard_numels)):
            _store(output, part, accumulate)

    if _point_to_point(group, rows):
        flat = rows.view(-1)
        received, works = _exchange_shards_for_reduction(flat, shard_numel, group, world)
        own_shard = rows[group_rank(group)]

        def sum_received():
            summed = received.view(world - 1, shard_numel).sum(dim=0) if world > 2 else received
            summed.add_(own_shard)
            store_parts(summed.div_(world) if average else summed)

        return _finish(works, sum_received, async_op)
    result = rows.new_empty(shard_numel)
    op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
    work = _REDUCE_SCATTER_FROM_FLAT(result, rows.view(-1), op=op, group=group, async_op=async_op)
    return _finish(work, lambda: store_parts(result), async_op)


def _exchange_shards_for_reduction(flat_input: torch.Tensor, shard_numel: int, group, world: int):
    """Post the point-to-point messages of a reduce-scatter: send each peer its shard of `flat_input` and receive
    the peers' copies of our shard, one row each. Returns (received rows, work handles)."""
    rank = group_rank(group)
    received = flat_input.new_empty((world - 1) * shard_numel)
    peers = _peers_in_ring_order(rank, world)
    works = _post_messages(
        group, [(received[row * shard_numel:(row + 1) * shard_numel], source) for row, (_, source) in enumerate(peers)],
        [(flat_input[target * shard_numel:(target + 1) * shard_numel], target) for target, _ in peers])
    return received, works


def _store(output: torch.Tensor, value: torch.Tensor, accumulate: bool):
    if value.device != output.device:  # a reduction into host-resident main gradients (param_offload)
        value = value.to(output.device)
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
    gloo = backend_for(group, tensor.device) == "gloo"  # gloo's AVG is not used: sum, then divide
    op = dist.ReduceOp.SUM if (gloo or not average) else dist.ReduceOp.AVG
    work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    epilogue = (lambda: tensor.div_(world)) if (average and gloo) else None
    return _finish(work, epilogue, async_op)


def all_reduce_scalar_sum(value: torch.Tensor, group) -> torch.Tensor:
    """Sum of a small tensor over the group (used for norms and checks; not counted as training traffic)."""
    if group_size(group) > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


def broadcast_small(tensor: torch.Tensor, group, src_group_rank: int = 0) -> torch.Tensor:
    """`tensor` of group rank `src_group_rank` on every rank (a few elements; not counted as training traffic)."""
    if group_size(group) > 1:
        dist.broadcast(tensor, group=group, group_src=src_group_rank)
    return tensor


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
    """The device for this process's tensors on `group`: its accelerator when the group's backend serves it
    (nccl, or "cpu:gloo,cuda:nccl" on a GPU machine), else the CPU."""
    return resolve_device(backend=backend_of(group))

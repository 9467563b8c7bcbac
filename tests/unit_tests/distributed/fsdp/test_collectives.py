"""The gloo all-gather and reduce-scatter built from point-to-point messages: they match torch's stock
collectives at every rank, for every dtype and shard size, in place, concurrently with other collectives and
across groups; `PendingCollective.wait()` runs its epilogue once; the byte counter records what a ring sends;
at exit the module lets threads waiting for the GIL (gloo's workers) run before the interpreter finalizes."""

import itertools

import pytest
import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks

SHARD_LENGTHS = (1, 7, 1000)
HANG_TIMEOUT_S = 60  # every case takes well under a second; a mismatched message would otherwise block for minutes


def _on_ranks(world_size, fn, *args):
    return run_on_ranks(world_size, fn, *args, timeout_s=HANG_TIMEOUT_S)


def _bits(tensor):
    """The raw bytes of a tensor, so that comparisons are bit-for-bit whatever the dtype."""
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def _rank_data(rank, numel, dtype, salt=0):
    """Data that differs per rank and per call and that every rank can rebuild for any other rank."""
    generator = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=generator).to(dtype)
    return torch.randint(-2**30, 2**30, (numel,), generator=generator, dtype=dtype)


def _integer_valued(rank, numel, dtype, salt=0):
    """Small integers stored as floats: their sums are exact in bf16 and fp32 whatever the summation order."""
    generator = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randint(-8, 9, (numel,), generator=generator).to(dtype)


# ---------------------------------------------------------------------------------------------------------------
# all-gather


def _gather_like_stock(dtype):
    import torch.distributed as dist

    from megatron_fsdp import collectives

    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    cases = []
    for salt, numel in enumerate(SHARD_LENGTHS):
        for async_op in (False, True):
            shard = _rank_data(rank, numel, dtype, salt)
            expected = torch.empty(world * numel, dtype=dtype)
            dist.all_gather_single(expected, shard, group=group)
            output = torch.full((world * numel,), 3, dtype=dtype)
            pending = collectives.all_gather_flat(output, shard, group, collectives.CommunicationCounter(),
                                                  async_op=async_op)
            done_before_wait = pending.done
            pending.wait()
            cases.append((numel, async_op, done_before_wait, output, expected))
    return cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_gather_matches_stock_all_gather_bit_for_bit(world_size, dtype):
    for cases in _on_ranks(world_size, _gather_like_stock, dtype):
        assert len(cases) == 2 * len(SHARD_LENGTHS)
        for numel, async_op, done_before_wait, output, expected in cases:
            assert output.dtype == dtype and output.numel() == world_size * numel
            assert torch.equal(_bits(output), _bits(expected)), (numel, async_op)
            assert done_before_wait == (not async_op)


def _gather_into_views(async_op):
    import torch.distributed as dist

    from megatron_fsdp import collectives

    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    numel, margin = 5, 3
    shard = _rank_data(rank, numel, torch.float32)
    expected = torch.empty(world * numel)
    dist.all_gather_single(expected, shard, group=group)

    # the output is the middle of a larger buffer; what lies around it must not change
    larger = torch.full((margin + world * numel + margin,), -7.0)
    pending = collectives.all_gather_flat(larger[margin:margin + world * numel], shard, group,
                                          collectives.CommunicationCounter(), async_op=async_op)
    pending.wait()

    # in-place: the shard already sits in this rank's own slice of the output
    in_place = torch.full((world * numel,), float("nan"))
    own_slice = in_place[rank * numel:(rank + 1) * numel]
    own_slice.copy_(shard)
    collectives.all_gather_flat(in_place, own_slice, group, collectives.CommunicationCounter(),
                                async_op=async_op).wait()
    return larger, in_place, expected


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_gather_into_a_view_and_in_place(world_size, async_op):
    margin, numel = 3, 5
    for larger, in_place, expected in _on_ranks(world_size, _gather_into_views, async_op):
        assert torch.equal(_bits(larger[margin:margin + world_size * numel]), _bits(expected))
        assert torch.equal(larger[:margin], torch.full((margin,), -7.0))
        assert torch.equal(larger[-margin:], torch.full((margin,), -7.0))
        assert torch.equal(_bits(in_place), _bits(expected))


# ---------------------------------------------------------------------------------------------------------------
# reduce-scatter

REDUCE_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]


def _reduce_scatter_like_all_reduce(make_input, dtype_pairs):
    """Every combination of (input, output) dtype, shard length, average, accumulate and async, against an
    all-reduce of the same input, sliced to this rank's shard, averaged and stored as the docstring promises."""
    import torch.distributed as dist

    from megatron_fsdp import collectives

    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    cases = []
    combinations = itertools.product(dtype_pairs, SHARD_LENGTHS, (False, True), (False, True), (False, True))
    for salt, ((input_dtype, output_dtype), shard_numel, average, accumulate, async_op) in enumerate(combinations):
        flat_input = make_input(rank, world * shard_numel, input_dtype, salt)
        input_before = flat_input.clone()
        start = torch.arange(shard_numel, dtype=output_dtype) + 0.5
        output = start.clone() if accumulate else torch.full_like(start, float("nan"))

        reduced = flat_input.clone()
        dist.all_reduce(reduced, group=group)
        own = reduced[rank * shard_numel:(rank + 1) * shard_numel]
        own = own.div_(world) if average else own
        expected = start + own if accumulate else own.to(output_dtype)

        collectives.reduce_scatter_flat(output, flat_input, group, collectives.CommunicationCounter(),
                                        average=average, accumulate=accumulate, async_op=async_op).wait()
        cases.append(((input_dtype, output_dtype, shard_numel, average, accumulate, async_op), output, expected,
                      torch.equal(_bits(flat_input), _bits(input_before))))
    return cases



@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_reduce_scatter_matches_all_reduce_then_slice_at_every_rank(world_size):
    """Integer-valued inputs make every sum exact, so the result is bit-for-bit the reference at every rank
    (the first, the last and, with three or four ranks, the middle ones), and the input is left as it was."""
    per_rank = _on_ranks(world_size, _reduce_scatter_like_all_reduce, _integer_valued, REDUCE_DTYPES)
    for rank, cases in enumerate(per_rank):
        assert len(cases) == len(REDUCE_DTYPES) * len(SHARD_LENGTHS) * 8
        for case, output, expected, input_unchanged in cases:
            assert output.dtype == case[1], (rank, case)
            assert torch.equal(_bits(output), _bits(expected)), (rank, case, output, expected)
            assert input_unchanged, (rank, case)


@pytest.mark.parametrize("world_size", [3])
def test_reduce_scatter_of_random_values_matches_all_reduce_closely(world_size):
    per_rank = _on_ranks(world_size, _reduce_scatter_like_all_reduce, _rank_data, [(torch.float32, torch.float32)])
    for rank, cases in enumerate(per_rank):
        for case, output, expected, input_unchanged in cases:
            # gloo's all-reduce and the local sum add the three ranks' copies in different orders, so the fp32
            # results may differ in the last bits (sums of unit normals are of order 1, an ulp there is ~1e-7)
            assert (output - expected).abs().max().item() < 1e-6, (rank, case)
            assert input_unchanged, (rank, case)


# ---------------------------------------------------------------------------------------------------------------
# concurrency


def _expected_gather(world, numel, dtype, salt):
    return torch.cat([_rank_data(r, numel, dtype, salt) for r in range(world)])


def _expected_reduction(rank, world, shard_numel, salt):
    total = sum(_integer_valued(r, world * shard_numel, torch.float32, salt) for r in range(world))
    return total[rank * shard_numel:(rank + 1) * shard_numel]


def _start_gather(group, rank, world, numel, salt, results):
    from megatron_fsdp import collectives

    output = torch.empty(world * numel)
    pending = collectives.all_gather_flat(output, _rank_data(rank, numel, torch.float32, salt), group,
                                          collectives.CommunicationCounter(), async_op=True)
    results.append(("gather", numel, salt, output))
    return pending


def _start_reduction(group, rank, world, shard_numel, salt, results):
    from megatron_fsdp import collectives

    output = torch.empty(shard_numel)
    pending = collectives.reduce_scatter_flat(output, _integer_valued(rank, world * shard_numel, torch.float32, salt),
                                              group, collectives.CommunicationCounter(), async_op=True)
    results.append(("reduce", shard_numel, salt, output))
    return pending


def _check(results, rank, world):
    """Names of the results that differ from what every rank can compute for itself."""
    wrong = []
    for kind, numel, salt, output in results:
        if kind == "gather":
            expected = _expected_gather(world, numel, torch.float32, salt)
        else:
            expected = _expected_reduction(rank, world, numel, salt)
        if not torch.equal(output, expected):
            wrong.append((kind, numel, salt))
    return wrong


def _many_in_flight_on_one_group():
    import torch.distributed as dist

    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    results, pendings = [], []
    pendings.append(_start_gather(group, rank, world, 3, 1, results))
    pendings.append(_start_reduction(group, rank, world, 40, 2, results))
    stock = torch.full((6,), float(rank + 1))
    stock_work = dist.all_reduce(stock, group=group, async_op=True)
    pendings.append(_start_gather(group, rank, world, 2000, 3, results))
    pendings.append(_start_reduction(group, rank, world, 1, 4, results))
    pendings.append(_start_gather(group, rank, world, 1, 5, results))
    pendings.append(_start_reduction(group, rank, world, 500, 6, results))
    pendings.append(_start_reduction(group, rank, world, 40, 7, results))  # same size as one still in flight
    for pending in reversed(pendings[3:]):
        pending.wait()
    stock_work.wait()
    for pending in reversed(pendings[:3]):
        pending.wait()
    stock_expected = torch.full((6,), float(world * (world + 1) // 2))
    return len(results), _check(results, rank, world), torch.equal(stock, stock_expected)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_concurrent_collectives_on_one_group_waited_out_of_order(world_size):
    assert _on_ranks(world_size, _many_in_flight_on_one_group) == [(7, [], True)] * world_size


def _in_flight_on_two_groups():
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    second = dist.new_group(list(range(world)))
    results, pendings = [], []
    pendings.append(_start_gather(dist.group.WORLD, rank, world, 300, 1, results))
    pendings.append(_start_gather(second, rank, world, 300, 2, results))
    pendings.append(_start_reduction(second, rank, world, 70, 3, results))
    pendings.append(_start_reduction(dist.group.WORLD, rank, world, 70, 4, results))
    pendings.append(_start_gather(second, rank, world, 5, 5, results))
    for pending in reversed(pendings):
        pending.wait()
    dist.destroy_process_group(second)
    return len(results), _check(results, rank, world)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_concurrent_collectives_on_two_groups(world_size):
    assert _on_ranks(world_size, _in_flight_on_two_groups) == [(5, [])] * world_size


def _post_and_wait_in_a_forked_child(results):
    from megatron_fsdp.collectives import PendingCollective, post_in_background

    work = _CountingWork()
    PendingCollective(post_in_background(lambda: [work])).wait()
    results.put(work.waits)


def test_a_forked_child_posts_on_a_thread_of_its_own():
    import multiprocessing

    from megatron_fsdp.collectives import PendingCollective, post_in_background

    PendingCollective(post_in_background(lambda: [])).wait()  # this process's posting thread is running
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_post_and_wait_in_a_forked_child, args=(results,))
    child.start()
    child.join(HANG_TIMEOUT_S)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0 and results.get(timeout=1) == 1


def _gather_beside_main_thread_messages_on_one_group():
    """Rank 0 holds its posting thread back, so its main thread's own message exchange on the group goes out
    before its gather's messages; the other ranks post the gather first. Without a tag of their own the gather's
    messages would be matched with the main thread's (a size mismatch, or wrong data)."""
    import threading

    import torch.distributed as dist

    from megatron_fsdp.collectives import PendingCollective, post_in_background

    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    release = threading.Event()
    if rank == 0:
        post_in_background(lambda: [release.wait(HANG_TIMEOUT_S)] and [])
    else:
        release.set()
    results = []
    pending = _start_gather(group, rank, world, 50, 1, results)
    if rank != 0:  # the posting thread is first in, first out: once this is posted, so is the gather
        PendingCollective(post_in_background(lambda: [])).wait()
    outgoing, incoming = torch.full((7,), float(rank)), torch.empty(7)
    next_rank, prev_rank = (rank + 1) % world, (rank - 1) % world
    works = [dist.isend(outgoing, next_rank, group=group), dist.irecv(incoming, prev_rank, group=group)]
    for work in works:
        work.wait()
    release.set()
    pending.wait()
    return _check(results, rank, world), torch.equal(incoming, torch.full((7,), float(prev_rank)))


@pytest.mark.parametrize("world_size", [2, 3])
def test_gather_messages_do_not_match_other_messages_on_the_same_group(world_size):
    assert _on_ranks(world_size, _gather_beside_main_thread_messages_on_one_group) == [([], True)] * world_size


# ---------------------------------------------------------------------------------------------------------------
# PendingCollective


class _CountingWork:
    def __init__(self):
        self.waits = 0

    def wait(self):
        self.waits += 1


@pytest.mark.parametrize("as_list", [False, True])
def test_pending_collective_waits_each_handle_and_runs_the_epilogue_once(as_list):
    from megatron_fsdp.collectives import PendingCollective

    works = [_CountingWork(), _CountingWork()] if as_list else [_CountingWork()]
    epilogue_runs = []
    pending = PendingCollective(works if as_list else works[0], lambda: epilogue_runs.append(len(epilogue_runs)))
    assert not pending.done and epilogue_runs == []
    pending.wait()
    pending.wait()
    pending.wait()
    assert pending.done
    assert [work.waits for work in works] == [1] * len(works)
    assert epilogue_runs == [0]


def test_pending_collective_without_work_runs_only_the_epilogue():
    from megatron_fsdp.collectives import PendingCollective

    epilogue_runs = []
    pending = PendingCollective(None, lambda: epilogue_runs.append(1))
    pending.wait()
    pending.wait()
    assert pending.done and epilogue_runs == [1]


def test_posting_thread_posts_off_the_calling_thread_in_submission_order():
    import threading

    from megatron_fsdp.collectives import PendingCollective, post_in_background

    release = threading.Event()
    posted = []

    def post_after_release(index):
        def post():
            release.wait(HANG_TIMEOUT_S)
            posted.append((index, threading.current_thread() is threading.main_thread()))
            return [_CountingWork()]
        return post

    pendings = [PendingCollective(post_in_background(post_after_release(index))) for index in range(5)]
    assert posted == []  # the caller is handed its collectives before any message is posted
    release.set()
    for pending in reversed(pendings):
        pending.wait()
    assert posted == [(index, False) for index in range(5)]
    assert all(pending.done for pending in pendings)


def test_an_error_while_posting_is_raised_by_wait_and_later_posts_still_run():
    from megatron_fsdp.collectives import PendingCollective, post_in_background

    def failing_post():
        raise RuntimeError("peer 2 is gone")

    failed = PendingCollective(post_in_background(failing_post))
    work = _CountingWork()
    after = PendingCollective(post_in_background(lambda: [work]))
    with pytest.raises(RuntimeError, match="peer 2 is gone"):
        failed.wait()
    assert not failed.done
    after.wait()
    assert after.done and work.waits == 1


def test_posting_thread_keeps_no_buffer_alive_after_wait():
    import gc
    import weakref

    from megatron_fsdp.collectives import PendingCollective, post_in_background

    def post_holding(buffer):  # a post whose closure holds `buffer`, as the collectives' closures hold theirs
        return lambda: [_CountingWork()] if buffer.numel() else []

    buffer = torch.zeros(1000)
    buffer_ref = weakref.ref(buffer)
    pending = PendingCollective(post_in_background(post_holding(buffer)))
    pending.wait()
    del buffer, pending
    gc.collect()
    assert buffer_ref() is None


def _accumulate_and_wait_twice():
    import torch.distributed as dist

    from megatron_fsdp import collectives

    world = dist.get_world_size()
    output = torch.full((4,), 10.0)
    pending = collectives.reduce_scatter_flat(output, torch.ones(world * 4), dist.group.WORLD,
                                              collectives.CommunicationCounter(), accumulate=True, async_op=True)
    pending.wait()
    pending.wait()
    return output.tolist()


@pytest.mark.parametrize("world_size", [3])
def test_waiting_twice_on_an_accumulating_reduce_scatter_adds_once(world_size):
    assert _on_ranks(world_size, _accumulate_and_wait_twice) == [[10.0 + world_size] * 4] * world_size


# ---------------------------------------------------------------------------------------------------------------
# byte counts


def _count_bytes():
    import torch.distributed as dist

    from megatron_fsdp import collectives

    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    counter = collectives.CommunicationCounter()
    counts = []
    for dtype, numel, async_op in ((torch.float32, 6, False), (torch.bfloat16, 1000, True)):
        counter.reset()
        shard = _rank_data(rank, numel, dtype)
        collectives.all_gather_flat(torch.empty(world * numel, dtype=dtype), shard, group, counter,
                                    async_op=async_op).wait()
        flat = torch.ones(world * numel, dtype=dtype)
        collectives.reduce_scatter_flat(torch.empty(numel, dtype=dtype), flat, group, counter,
                                        async_op=async_op).wait()
        counts.append((counter.snapshot(), dict(counter.calls)))
    return counts


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_counter_records_what_a_ring_sends(world_size):
    from megatron_fsdp import collectives

    expected = []
    for element_size, numel in ((4, 6), (2, 1000)):
        reduced_bytes = world_size * numel * element_size
        expected.append((
            {collectives.ALL_GATHER: numel * element_size * (world_size - 1),
             collectives.REDUCE_SCATTER: reduced_bytes * (world_size - 1) // world_size,
             collectives.ALL_REDUCE: 0, collectives.BROADCAST: 0},
            {collectives.ALL_GATHER: 1, collectives.REDUCE_SCATTER: 1},
        ))
    assert _on_ranks(world_size, _count_bytes) == [expected] * world_size


def _single_rank_groups():
    import torch.distributed as dist

    from megatron_fsdp import collectives

    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group([r]) for r in range(world)]  # every rank takes part in creating every group
    alone = groups[rank]
    counter = collectives.CommunicationCounter()
    shard = _rank_data(rank, 5, torch.float32)

    gathered = torch.full((5,), float("nan"))
    collectives.all_gather_flat(gathered, shard, alone, counter, async_op=True).wait()
    in_place = shard.clone()
    collectives.all_gather_flat(in_place, in_place, alone, counter).wait()

    flat = _integer_valued(rank, 5, torch.bfloat16)
    summed = torch.full((5,), float("nan"))
    collectives.reduce_scatter_flat(summed, flat, alone, counter).wait()
    accumulated = torch.full((5,), 2.0)
    collectives.reduce_scatter_flat(accumulated, flat, alone, counter, average=True, accumulate=True,
                                    async_op=True).wait()
    for group in groups:
        if group != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)
    return (counter.snapshot(), dict(counter.calls),
            torch.equal(gathered, shard), torch.equal(in_place, shard),
            torch.equal(summed, flat.float()), torch.equal(accumulated, 2.0 + flat.float()))


@pytest.mark.parametrize("world_size", [2, 3])
def test_single_rank_group_records_nothing_and_still_gives_the_result(world_size):
    from megatron_fsdp import collectives

    nothing = {collectives.ALL_GATHER: 0, collectives.REDUCE_SCATTER: 0, collectives.ALL_REDUCE: 0,
               collectives.BROADCAST: 0}
    assert _on_ranks(world_size, _single_rank_groups) == [(nothing, {}, True, True, True, True)] * world_size


def _gather_pieces_in_place(packed_piece_bytes):
    """A row-aligned group (layout.py) gathered piece by piece straight into its unsharded form equals the stock
    all-gather followed by the copy-out (a group with a tail pad: its shards are aligned for 3 outer ranks), and
    counts the bytes of a ring all-gather of the whole shard; pieces below `packed_piece_bytes` travel packed,
    and the handle holds their buffers (one received per peer, one sent) until it is waited for."""
    import torch.distributed as dist

    from megatron_fsdp import collectives
    from megatron_fsdp.layout import GroupLayout
    from megatron_fsdp.resharding import copy_gathered_to_unsharded, piece_sizes, rank_pieces_of_unsharded

    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    layout = GroupLayout([(7, 3), (5,), (1, 4), (2,)], world, 3)
    assert layout.used_shard_numel < layout.shard_numel
    shard = _rank_data(rank, layout.shard_numel, torch.float32)
    gathered = torch.empty(world * layout.shard_numel)
    dist.all_gather_single(gathered, shard, group=group)
    expected = torch.zeros(layout.padded_numel)
    copy_gathered_to_unsharded(layout, gathered, expected)
    unsharded = torch.full((layout.padded_numel,), float("nan"))
    counter = collectives.CommunicationCounter()
    outputs = [rank_pieces_of_unsharded(layout, unsharded, r) for r in range(world)]
    own = list(torch.split(shard, piece_sizes(layout)))
    default_bytes, collectives.PACKED_PIECE_BYTES = collectives.PACKED_PIECE_BYTES, packed_piece_bytes
    try:
        pending = collectives.all_gather_pieces_in_place(outputs, own, group, counter, async_op=True)
    finally:
        collectives.PACKED_PIECE_BYTES = default_bytes
    staging = pending.staging_bytes
    pending.wait()
    packed = [piece.numel() for piece in own if piece.numel() * 4 < packed_piece_bytes]
    expected_staging = world * sum(packed) * 4 if len(packed) > 1 else 0
    return (unsharded, expected, counter.snapshot()["all_gather"], 4 * layout.shard_numel * (world - 1), len(own),
            staging, expected_staging, len(packed), pending.staging_bytes)


@pytest.mark.parametrize("packed_piece_bytes, packed_pieces", [(0, 0), (13, 3), (1 << 16, 5)])
@pytest.mark.parametrize("world_size", [2, 3])
def test_all_gather_of_pieces_lands_in_place_like_stock_gather_and_copy_out(world_size, packed_piece_bytes,
                                                                             packed_pieces):
    """Every piece in place; the three smallest packed (at most 3 elements) and the two others in place; all
    packed."""
    for (unsharded, expected, counted, ring_bytes, pieces, staging, expected_staging, packed,
         staging_after_wait) in _on_ranks(world_size, _gather_pieces_in_place, packed_piece_bytes):
        assert pieces == 5  # four chunks and the tail pad
        assert packed == packed_pieces, packed
        assert staging == expected_staging and staging_after_wait == 0, (staging, expected_staging)
        assert counted == ring_bytes
        assert torch.equal(_bits(unsharded), _bits(expected))


# ---------------------------------------------------------------------------------------------------------------
# exit


def _exit_hook_lets_a_thread_waiting_for_the_gil_finish():
    """A thread that needs the GIL to finish (as a gloo worker dropping a collective's tensors does) while this
    thread holds it: it has not run before the exit hook, and has once the hook returns."""
    import sys
    import threading
    import time

    from megatron_fsdp import collectives

    release, finished = threading.Event(), []

    def worker():
        release.wait(HANG_TIMEOUT_S)
        finished.append(True)

    thread = threading.Thread(target=worker)
    thread.start()
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(HANG_TIMEOUT_S)  # this thread keeps the GIL until it sleeps or blocks
    try:
        release.set()
        busy_until = time.perf_counter() + 0.05
        while time.perf_counter() < busy_until:  # the worker wakes meanwhile and waits for the GIL
            pass
        before = list(finished)
        # The hook's pause, long enough here that a loaded machine schedules the worker within it.
        at_exit_s, collectives.GLOO_WORKERS_AT_EXIT_S = collectives.GLOO_WORKERS_AT_EXIT_S, 1.0
        try:
            collectives._let_gloo_workers_finish()
        finally:
            collectives.GLOO_WORKERS_AT_EXIT_S = at_exit_s
        after = list(finished)
    finally:
        sys.setswitchinterval(switch_interval)
        thread.join(HANG_TIMEOUT_S)
    return before, after, collectives._gloo_in_use()


@pytest.mark.parametrize("world_size", [2])
def test_exit_hook_lets_gloo_workers_take_the_gil_before_finalization(world_size):
    assert _on_ranks(world_size, _exit_hook_lets_a_thread_waiting_for_the_gil_finish) == [([], [True], True)] * 2


def test_loading_the_module_registers_the_exit_hook(monkeypatch):
    """A fresh copy of the module, loaded with `atexit.register` recording (nothing is registered for real)."""
    import atexit
    import importlib.util

    from megatron_fsdp import collectives

    registered = []
    monkeypatch.setattr(atexit, "register", lambda fn, *args, **kwargs: registered.append(fn) or fn)
    spec = importlib.util.spec_from_file_location("megatron_fsdp.collectives_copy", collectives.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    assert registered == [fresh._let_gloo_workers_finish]

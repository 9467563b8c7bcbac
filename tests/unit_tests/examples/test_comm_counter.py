"""The collective counter of the Megatron-FSDP benchmark counts payload bytes once per call and passes results."""

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.multiprocess_harness import run_on_ranks


def _count_known_collectives():
    from examples.megatron_fsdp import comm_counter

    original_all_reduce = dist.all_reduce
    counter = comm_counter.install()
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        counter.reset()
        dist.all_reduce(torch.ones(4))  # outside counting(): not recorded
        with counter.counting():
            summed = torch.full((10,), float(rank + 1))
            dist.all_reduce(summed)  # 40 bytes
            gathered = torch.empty(2 * 6)
            dist.all_gather_into_tensor(gathered, torch.full((6,), float(rank)))  # 48 bytes, nested call once
            scattered = torch.empty(3)
            dist.reduce_scatter_tensor(scattered, torch.arange(6, dtype=torch.float32))  # 24 bytes
            exchanged = torch.empty(4)
            dist.all_to_all_single(exchanged, torch.full((4,), float(rank)))  # 16 bytes
            dist.broadcast(torch.zeros(8, dtype=torch.float64), src=0)  # 64 bytes
        snapshot = counter.snapshot()
    finally:
        comm_counter.uninstall()
    assert dist.all_reduce is original_all_reduce
    assert torch.equal(summed, torch.full((10,), 3.0))
    assert torch.equal(gathered, torch.tensor([0.0] * 6 + [1.0] * 6))
    assert torch.equal(scattered, torch.arange(3 * rank, 3 * rank + 3, dtype=torch.float32) * world_size)
    assert torch.equal(exchanged, torch.tensor([0.0, 0.0, 1.0, 1.0]))
    return snapshot


@pytest.mark.parametrize("world_size", [2])
def test_counter_records_payload_bytes_per_kind(world_size):
    for snapshot in run_on_ranks(world_size, _count_known_collectives):
        assert snapshot["payload_bytes"] == {
            "all_reduce": 40,
            "all_gather": 48,
            "reduce_scatter": 24,
            "all_to_all": 16,
            "broadcast": 64,
        }
        assert snapshot["calls"] == dict.fromkeys(snapshot["payload_bytes"], 1)
        # ring on 2 ranks: (2 * 40 + 48 + 24 + 16 + 64) / 2
        assert snapshot["wire_bytes"] == 116.0
        assert snapshot["volume_bytes"] == 2 * 40 + 48 + 24 + 16 + 64


def _count_all_to_all_that_keeps_own_split():
    from examples.megatron_fsdp import comm_counter

    counter = comm_counter.install()
    try:
        rank = dist.get_rank()
        counter.reset()
        with counter.counting():
            # Each rank sends 3 floats to the other and keeps its own 3 locally: a 6-float logical exchange.
            splits = [0, 3] if rank == 0 else [3, 0]
            received = torch.empty(3)
            dist.all_to_all_single(received, torch.full((3,), float(rank)), output_split_sizes=splits,
                                   input_split_sizes=splits)
        snapshot = counter.snapshot()
    finally:
        comm_counter.uninstall()
    assert torch.equal(received, torch.full((3,), float(1 - rank)))
    return snapshot


@pytest.mark.parametrize("world_size", [2])
def test_all_to_all_counts_the_split_a_rank_keeps(world_size):
    for snapshot in run_on_ranks(world_size, _count_all_to_all_that_keeps_own_split):
        assert snapshot["payload_bytes"] == {"all_to_all": 24}
        assert snapshot["calls"] == {"all_to_all": 1}


def _count_isend_irecv_pairs():
    from examples.megatron_fsdp import comm_counter

    counter = comm_counter.install()
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        peers = [peer for peer in range(world_size) if peer != rank]
        counter.reset()
        with counter.counting():
            # Rank r sends 2 * (r + 1) float32 values to every peer, so each rank's count is its own.
            sent = torch.full((2 * (rank + 1),), float(rank))
            received = {peer: torch.empty(2 * (peer + 1)) for peer in peers}
            works = [dist.irecv(received[peer], src=peer) for peer in peers]
            works += [dist.isend(sent, dst=peer) for peer in peers]
            for work in works:
                work.wait()
        snapshot = counter.snapshot()
    finally:
        comm_counter.uninstall()
    for peer in peers:
        assert torch.equal(received[peer], torch.full((2 * (peer + 1),), float(peer)))
    return snapshot


@pytest.mark.parametrize("world_size", [2, 3])
def test_isend_is_counted_by_the_sender_and_irecv_is_not(world_size):
    for rank, snapshot in enumerate(run_on_ranks(world_size, _count_isend_irecv_pairs)):
        sent_bytes = 8 * (rank + 1) * (world_size - 1)
        assert snapshot["payload_bytes"] == {"point_to_point": sent_bytes}
        assert snapshot["calls"] == {"point_to_point": world_size - 1}
        assert snapshot["wire_bytes"] == sent_bytes
        # bytes sent * g / (g - 1): the volume of an all-gather whose shard is the sent tensor
        assert snapshot["volume_bytes"] == 8 * (rank + 1) * world_size


def _count_blocking_send_around_a_ring():
    from examples.megatron_fsdp import comm_counter

    counter = comm_counter.install()
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        received = torch.empty(5, dtype=torch.float64)
        counter.reset()
        with counter.counting():
            # send() forwards to isend(): one message, counted once. Rank 0 sends first so the ring cannot stall.
            if rank == 0:
                dist.send(torch.full((5,), float(rank), dtype=torch.float64), dst=1)
                dist.recv(received, src=world_size - 1)
            else:
                dist.recv(received, src=rank - 1)
                dist.send(torch.full((5,), float(rank), dtype=torch.float64), dst=(rank + 1) % world_size)
        snapshot = counter.snapshot()
    finally:
        comm_counter.uninstall()
    assert torch.equal(received, torch.full((5,), float((rank - 1) % world_size), dtype=torch.float64))
    return snapshot


@pytest.mark.parametrize("world_size", [2, 3])
def test_blocking_send_is_counted_once(world_size):
    for snapshot in run_on_ranks(world_size, _count_blocking_send_around_a_ring):
        assert snapshot["payload_bytes"] == {"point_to_point": 40}
        assert snapshot["calls"] == {"point_to_point": 1}
        assert snapshot["wire_bytes"] == 40.0
        assert snapshot["volume_bytes"] == 40 * world_size / (world_size - 1)


def _count_package_and_stock_collectives(shard_numel):
    from examples.megatron_fsdp import comm_counter
    from megatron_fsdp import collectives

    counter = comm_counter.install()
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        group = dist.group.WORLD
        package_counter = collectives.CommunicationCounter()
        shard = torch.arange(shard_numel, dtype=torch.float32) + 100 * rank
        flat = torch.arange(world_size * shard_numel, dtype=torch.float32) * (rank + 1)
        snapshots = {}
        for name, run in (
            ("package_all_gather", lambda out: collectives.all_gather_flat(out, shard, group, package_counter)),
            ("stock_all_gather", lambda out: dist.all_gather_into_tensor(out, shard, group=group)),
        ):
            gathered = torch.empty(world_size * shard_numel)
            counter.reset()
            with counter.counting():
                run(gathered)
            snapshots[name] = counter.snapshot()
            expected = torch.cat([torch.arange(shard_numel, dtype=torch.float32) + 100 * r for r in range(world_size)])
            assert torch.equal(gathered, expected), name
        for name, run in (
            ("package_reduce_scatter", lambda out: collectives.reduce_scatter_flat(out, flat, group, package_counter)),
            ("stock_reduce_scatter", lambda out: dist.reduce_scatter_tensor(out, flat, group=group)),
        ):
            reduced = torch.empty(shard_numel)
            counter.reset()
            with counter.counting():
                run(reduced)
            snapshots[name] = counter.snapshot()
            own = torch.arange(rank * shard_numel, (rank + 1) * shard_numel, dtype=torch.float32)
            assert torch.equal(reduced, own * sum(range(1, world_size + 1))), name
        snapshots["package_bytes_sent"] = dict(package_counter.bytes_sent)
    finally:
        comm_counter.uninstall()
    return snapshots


@pytest.mark.parametrize("world_size", [2, 3])
def test_package_point_to_point_collectives_count_like_the_stock_ones(world_size):
    shard_numel = 6
    shard_bytes, flat_bytes = 4 * shard_numel, 4 * shard_numel * world_size
    for snapshots in run_on_ranks(world_size, _count_package_and_stock_collectives, shard_numel):
        package_sent = snapshots["package_bytes_sent"]
        gather, stock_gather = snapshots["package_all_gather"], snapshots["stock_all_gather"]
        # On gloo the package sends the shard to each peer; the counter sees messages, not a collective.
        assert gather["payload_bytes"] == {"point_to_point": shard_bytes * (world_size - 1)}
        assert gather["calls"] == {"point_to_point": world_size - 1}
        assert stock_gather["payload_bytes"] == {"all_gather": flat_bytes}
        assert gather["volume_bytes"] == stock_gather["volume_bytes"] == flat_bytes
        assert gather["wire_bytes"] == stock_gather["wire_bytes"] == package_sent["all_gather"]
        scatter, stock_scatter = snapshots["package_reduce_scatter"], snapshots["stock_reduce_scatter"]
        assert scatter["payload_bytes"] == {"point_to_point": shard_bytes * (world_size - 1)}
        assert stock_scatter["payload_bytes"] == {"reduce_scatter": flat_bytes}
        assert scatter["volume_bytes"] == stock_scatter["volume_bytes"] == flat_bytes
        assert scatter["wire_bytes"] == stock_scatter["wire_bytes"] == package_sent["reduce_scatter"]

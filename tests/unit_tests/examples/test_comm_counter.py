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

"""The rank pool itself: results per rank, real collectives, failures reported with the failing rank."""

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.multiprocess_harness import MultiRankError, run_on_ranks


def _rank_and_sum():
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return dist.get_rank(), dist.get_world_size(), value.item()


def _fail_on_last_rank():
    if dist.get_rank() == dist.get_world_size() - 1:
        raise ValueError("deliberate failure")
    return "fine"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_all_reduce_sums_ranks(world_size):
    results = run_on_ranks(world_size, _rank_and_sum)
    expected_sum = world_size * (world_size + 1) / 2
    assert results == [(rank, world_size, expected_sum) for rank in range(world_size)]


@pytest.mark.parametrize("world_size", [2])
def test_failure_names_rank_and_pool_recovers(world_size):
    with pytest.raises(MultiRankError, match=r"ranks \[1\] of 2(.|\n)*deliberate failure"):
        run_on_ranks(world_size, _fail_on_last_rank)
    assert [r[2] for r in run_on_ranks(world_size, _rank_and_sum)] == [3.0, 3.0]

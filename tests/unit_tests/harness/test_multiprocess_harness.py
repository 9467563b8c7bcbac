"""The rank pool itself: results per rank, real collectives, failures reported with the failing rank."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.harness.rank_task import inside_rank_task
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


# A body that fails these checks in the old way hangs until its timeout; this one ends such a test quickly
# (the expected failures arrive in well under a second).
SHORT_TIMEOUT_S = 15


def _unpicklable_values_by_rank():
    if dist.get_rank() == 0:
        return {"loss": 1.0, "activations": torch.ones(2, requires_grad=True) * 2}
    return (value for value in range(3))


def _returns_lambda():
    return lambda: dist.get_rank()


class _UnpicklableError(Exception):
    def __init__(self, rank, reason):
        super().__init__(f"rank {rank} gave up: {reason}")
        self.callback = lambda: rank  # neither the exception nor its attribute can be pickled


def _raise_unpicklable_error_on_last_rank():
    if dist.get_rank() == dist.get_world_size() - 1:
        raise _UnpicklableError(dist.get_rank(), "deliberate")
    return "fine"


def _exit_on_last_rank():
    if dist.get_rank() == dist.get_world_size() - 1:
        os._exit(3)
    return "fine"


def _identity(value):
    return value


def _rebuild_only_on_ranks(value):
    if not inside_rank_task():
        raise RuntimeError("this value can only be rebuilt on a rank")
    return value


class _OnlyRebuildsOnRanks:
    def __reduce__(self):
        return _rebuild_only_on_ranks, (0,)


def _first_rank_returns_rank_only_value():
    return _OnlyRebuildsOnRanks() if dist.get_rank() == 0 else "fine"


@pytest.mark.parametrize("world_size", [2])
def test_unpicklable_results_are_reported_per_rank(world_size):
    start = time.monotonic()
    with pytest.raises(MultiRankError) as raised:
        run_on_ranks(world_size, _unpicklable_values_by_rank, timeout_s=SHORT_TIMEOUT_S)
    assert time.monotonic() - start < SHORT_TIMEOUT_S / 2
    message = str(raised.value)
    assert "_unpicklable_values_by_rank failed on ranks [0, 1] of 2" in message
    rank_zero, rank_one = message.split("--- rank 0 ---")[1].split("--- rank 1 ---")
    assert "the value['activations'] is a torch.Tensor" in rank_zero
    assert "Cowardly refusing to serialize non-leaf tensor" in rank_zero
    assert "the value is a generator" in rank_one and "cannot pickle 'generator' object" in rank_one
    assert "Return plain Python values or detached CPU tensors" in rank_one
    assert [r[2] for r in run_on_ranks(world_size, _rank_and_sum)] == [3.0, 3.0]


@pytest.mark.parametrize("world_size", [2])
def test_returned_lambda_is_reported(world_size):
    with pytest.raises(MultiRankError, match=r"ranks \[0, 1\] of 2(.|\n)*_returns_lambda returned a value(.|\n)*"
                                             r"the value is a function that cannot be pickled"):
        run_on_ranks(world_size, _returns_lambda, timeout_s=SHORT_TIMEOUT_S)
    assert run_on_ranks(world_size, _identity, 7) == [7, 7]


@pytest.mark.parametrize("world_size", [2])
def test_unpicklable_exception_is_reported(world_size):
    with pytest.raises(MultiRankError, match=r"ranks \[1\] of 2(.|\n)*_UnpicklableError: rank 1 gave up: deliberate"):
        run_on_ranks(world_size, _raise_unpicklable_error_on_last_rank, timeout_s=SHORT_TIMEOUT_S)
    assert [r[2] for r in run_on_ranks(world_size, _rank_and_sum)] == [3.0, 3.0]


@pytest.mark.parametrize("world_size", [2])
def test_rank_that_exits_is_reported_at_once(world_size):
    start = time.monotonic()
    with pytest.raises(MultiRankError, match=r"ranks \[1\] of 2(.|\n)*exited \(exit code 3\) during _exit_on_last"):
        run_on_ranks(world_size, _exit_on_last_rank, timeout_s=SHORT_TIMEOUT_S)
    assert time.monotonic() - start < SHORT_TIMEOUT_S / 2
    assert [r[2] for r in run_on_ranks(world_size, _rank_and_sum)] == [3.0, 3.0]


@pytest.mark.parametrize("world_size", [2])
def test_unpicklable_argument_is_reported(world_size):
    with pytest.raises(MultiRankError, match=r"_identity and its arguments cannot be sent to the ranks: .*lambda"):
        run_on_ranks(world_size, _identity, lambda: 1, timeout_s=SHORT_TIMEOUT_S)
    results = run_on_ranks(world_size, _identity, torch.arange(3.0))
    assert len(results) == 2 and all(torch.equal(result, torch.arange(3.0)) for result in results)


@pytest.mark.parametrize("world_size", [2])
def test_result_that_fails_to_unpickle_is_reported_and_not_left_behind(world_size):
    with pytest.raises(MultiRankError, match=r"ranks \[0\] of 2(.|\n)*could not be unpickled here(.|\n)*"
                                             r"can only be rebuilt on a rank"):
        run_on_ranks(world_size, _first_rank_returns_rank_only_value, timeout_s=SHORT_TIMEOUT_S)
    # The other rank's answer to the failed task must not be taken for an answer to this one.
    assert [r[2] for r in run_on_ranks(world_size, _rank_and_sum)] == [3.0, 3.0]

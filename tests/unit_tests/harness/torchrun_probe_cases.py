"""Cases that `test_launched_world.py` runs under `torchrun --nproc-per-node 2 -m pytest` (not collected otherwise).

Every rank function appends a line to the file named by `PROBE_LOG`, so the outer test can count how often each
body ran and on which ranks. One case fails on purpose on rank 1 alone, to show the others do not hang.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from tests.unit_tests.multiprocess_harness import MultiRankError, run_on_ranks
from tests.unit_tests.test_utilities import Utils


def _record(log_path, label):
    with open(log_path, "a") as log:
        log.write(f"{label} {dist.get_rank()} {dist.get_world_size()}\n")
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return dist.get_rank(), dist.get_world_size(), value.item()


def _give_up_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gives up")
    value = torch.ones(1)
    dist.all_reduce(value)  # rank 0 waits here for rank 1, which never comes
    return value.item()


def test_whole_launch():
    assert run_on_ranks(2, _record, os.environ["PROBE_LOG"], "whole") == [(0, 2, 3.0), (1, 2, 3.0)]


def test_sub_group():
    assert run_on_ranks(1, _record, os.environ["PROBE_LOG"], "sub") == [(0, 1, 1.0)]


def test_needs_more_ranks():
    run_on_ranks(3, _record, os.environ["PROBE_LOG"], "never")


def test_failure_inside_a_collective_ends_quickly():
    start = time.monotonic()
    # Rank 1 closes its connections as it fails, so rank 0's all-reduce fails at once instead of timing out.
    with pytest.raises(MultiRankError, match=r"failed on ranks \[0, 1\] of 2(.|\n)*rank 1 gives up"):
        run_on_ranks(2, _give_up_on_rank_1)
    assert time.monotonic() - start < 30
    assert run_on_ranks(2, _record, os.environ["PROBE_LOG"], "after-failure") == [(0, 2, 3.0), (1, 2, 3.0)]


def test_rank_local_failure():
    assert Utils.rank != 1, "rank 1 fails here on its own"
    run_on_ranks(2, _record, os.environ["PROBE_LOG"], "never")


def test_utils_on_the_launched_world():
    Utils.initialize_model_parallel(tensor_model_parallel_size=2)
    assert (Utils.world_size, Utils.rank) == (2, int(os.environ["RANK"]))
    value = torch.tensor([float(Utils.rank)])
    dist.all_reduce(value, group=ps.get_tensor_model_parallel_group())
    assert value.item() == 1.0
    Utils.destroy_model_parallel()
    assert run_on_ranks(2, _record, os.environ["PROBE_LOG"], "after-utils")[1] == (1, 2, 3.0)

"""Tests under torchrun: each multi-rank body runs once across the launched ranks, and only rank 0 reports.

The end-to-end case launches `torchrun --nproc-per-node 2 -m pytest torchrun_probe_cases.py` and reads what
rank 0 printed and what every rank function logged. `Utils` is also checked inside rank tasks (rank pools,
or a sub-group of the launch when this file itself runs under torchrun).
"""

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from tests.unit_tests.harness import launched_world
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.test_utilities import Utils

REPO_ROOT = Path(__file__).resolve().parents[3]
PROBE_CASES = Path(__file__).with_name("torchrun_probe_cases.py")


def test_launch_is_read_from_the_environment():
    assert launched_world.launch_from_environment({}) is None
    assert launched_world.launch_from_environment({"WORLD_SIZE": "4"}) is None
    assert launched_world.launch_from_environment({"RANK": "3", "WORLD_SIZE": "4"}) == (3, 4, 4)
    environ = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    assert launched_world.launch_from_environment(environ) == (5, 8, 4)


@pytest.mark.skipif(launched_world.launched() is not None, reason="starts its own torchrun; run it without torchrun")
def test_probe_cases_under_torchrun(tmp_path):
    log = tmp_path / "probe.log"
    env = dict(os.environ, PROBE_LOG=str(log), PYTHONPATH=str(REPO_ROOT))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "pytest",
               str(PROBE_CASES), "-q", "-p", "no:cacheprovider", "-rs"]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout
    expected_lines = [
        # Rank 0 alone reports: its result line, and the other rank's outcomes in its summary.
        "1 failed, 4 passed, 1 skipped in",
        "torchrun rank 1: 1 failed, 4 passed, 1 skipped",
        "rank 1 FAILED tests/unit_tests/harness/torchrun_probe_cases.py::test_rank_local_failure",
        "needs a world of 3 ranks; torchrun launched 2",
        "left this test without answering",  # rank 0's verdict on rank 1's failure of its own
        "5 multi-rank bodies ran once across them (1 on a sub-group), 1 skipped for want of ranks",
    ]
    missing = [line for line in expected_lines if line not in output]
    assert not missing, f"{missing}\n--- stdout ---\n{output}\n--- stderr (tail) ---\n{done.stderr[-4000:]}"
    assert output.count(expected_lines[0]) == 1  # one session's result line: rank 1 printed nothing
    assert done.returncode != 0, "the probe has one deliberate failure"

    lines = Counter(log.read_text().splitlines())
    assert lines == Counter({"whole 0 2": 1, "whole 1 2": 1, "sub 0 1": 1, "after-failure 0 2": 1,
                             "after-failure 1 2": 1, "after-utils 0 2": 1, "after-utils 1 2": 1})


def _utils_inside_a_rank_task():
    world = dist.group.WORLD
    assert (Utils.world_size, Utils.rank) == (dist.get_world_size(), dist.get_rank())
    Utils.initialize_distributed()
    assert dist.group.WORLD is world  # the task's world is used, not replaced
    Utils.initialize_model_parallel(Utils.world_size)
    value = torch.tensor([1.0])
    dist.all_reduce(value, group=ps.get_tensor_model_parallel_group())
    sizes = (ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size(), value.item())
    Utils.destroy_model_parallel()
    Utils.initialize_model_parallel(1, Utils.world_size, None)
    sizes += (ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank())
    Utils.destroy_model_parallel()
    return sizes + (ps.model_parallel_is_initialized(),)


@pytest.mark.parametrize("world_size", [2])
def test_utils_inside_rank_tasks(world_size):
    results = run_on_ranks(world_size, _utils_inside_a_rank_task)
    assert results == [(world_size, 1, float(world_size), world_size, rank, False) for rank in range(world_size)]

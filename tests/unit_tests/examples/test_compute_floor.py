"""The compute-floor program trains the benchmark model in independent processes and reports every phase."""

import functools

import pytest
import torch.multiprocessing

from examples.megatron_fsdp import compute_floor
from tests.unit_tests import multiprocess_harness


@pytest.fixture
def processes_from_the_fork_server(monkeypatch):
    """`measure` starts its processes from the rank pools' fork server, which has imported torch and Megatron once
    per session, instead of spawning interpreters that import them each; they run the same worker."""
    multiprocess_harness._worker_context()  # the fork server with its preload
    monkeypatch.setattr(compute_floor.mp, "spawn",
                        functools.partial(torch.multiprocessing.start_processes, start_method="forkserver"))


def test_reports_positive_phase_medians_that_add_up_to_the_step(processes_from_the_fork_server):
    medians = compute_floor.measure("tiny", nproc=2, steps=2, warmup=1)
    assert set(medians) == {"forward", "backward", "optimizer step", "step"}
    assert all(value > 0 for value in medians.values())
    assert medians["step"] >= max(medians["forward"], medians["backward"], medians["optimizer step"])


def test_rejects_no_measured_steps():
    with pytest.raises(ValueError, match="--steps"):
        compute_floor.measure("tiny", nproc=2, steps=2, warmup=2)

"""The compute-floor program trains the benchmark model in independent processes and reports every phase.
`measure` starts them from the rank pools' fork server (conftest.py) instead of spawning interpreters."""

import pytest

from examples.megatron_fsdp import compute_floor


def test_reports_positive_phase_medians_that_add_up_to_the_step(processes_from_the_fork_server):
    medians = compute_floor.measure("tiny", nproc=2, steps=2, warmup=1)
    assert set(medians) == {"forward", "backward", "optimizer step", "step"}
    assert all(value > 0 for value in medians.values())
    assert medians["step"] >= max(medians["forward"], medians["backward"], medians["optimizer step"])


def test_rejects_no_measured_steps():
    with pytest.raises(ValueError, match="--steps"):
        compute_floor.measure("tiny", nproc=2, steps=2, warmup=2)

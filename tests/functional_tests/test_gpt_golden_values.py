"""Each GPT case trains as its golden values say (loss per iteration, zero-gradient counts, memory), and each
checkpoint-resume case continues exactly where the uninterrupted run was.

Golden values only say that behaviour did not change; `test_gpt_references.py` holds every case to an
independent reference run."""

import pytest

from tests.functional_tests.runner import (
    ABSOLUTE_TOLERANCE,
    compare_series,
    compare_with_golden,
    golden_mismatch_message,
    list_cases,
    load_case,
    load_golden,
)

# A resume in another layout (RESUME_MODEL_ARGS) continues from the same state with another summation order: its
# losses are held to the uninterrupted run as a layout is held to its reference (test_gpt_references.py), its zero
# counts to the accidental zeros of a summation order (runner.py).
ANOTHER_LAYOUT_LOSS_RTOL = 1e-5

# Four or eight ranks on two cores take longer (the label is informational: the full suite runs them).
SLOW_CASES = {name for name in list_cases("gpt") if load_case(name).nproc_per_node > 2}
CASES = [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_CASES else name for name in list_cases("gpt")]


@pytest.mark.parametrize("case_name", CASES)
def test_case_matches_golden_values(case_name, case_result):
    case = load_case(case_name)
    golden = load_golden(case)
    result = case_result(case_name)
    problems = compare_with_golden(case, result.metrics, golden)
    assert not problems, golden_mismatch_message(case, problems)
    if case.test_type != "ckpt-resume":
        return
    half = case.train_iters // 2
    # Same weights, optimizer state, RNG and data position: the launch that loads the checkpoint of iteration N/2
    # trains the second half bit for bit as the uninterrupted run (in the same layout).
    for metric in ("lm loss", "num-zeros"):
        resumed = result.resumed_metrics[metric]
        assert sorted(resumed) == list(range(half + 1, case.train_iters + 1)), (
            f"{case_name}: the launch resumed at {half} logged {metric!r} for iterations {sorted(resumed)}, "
            f"expected {half + 1} to {case.train_iters}")
        uninterrupted = {i: v for i, v in result.metrics[metric].items() if i in resumed}
        rtol, atol = 0.0, 0.0
        if case.resumes_in_another_layout:
            rtol = ANOTHER_LAYOUT_LOSS_RTOL if metric == "lm loss" else 0.0
            atol = ABSOLUTE_TOLERANCE.get(metric, 0.0)
        problems += compare_series(f"{metric} (resumed)", uninterrupted, resumed, rtol=rtol, atol=atol)
    assert not problems, "\n".join(problems)

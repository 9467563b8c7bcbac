"""Each GPT case trains as its golden values say (loss per iteration, zero-gradient counts, memory), and each
checkpoint-resume case continues exactly where the uninterrupted run was.

Golden values only say that behaviour did not change; `test_gpt_references.py` holds every case to an
independent reference run."""

import pytest

from tests.functional_tests.runner import compare_series, compare_with_golden, list_cases, load_case, load_golden

# Four or eight ranks on two cores take longer (the label is informational: the full suite runs them).
SLOW_CASES = {name for name in list_cases("gpt") if load_case(name).nproc_per_node > 2}
CASES = [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_CASES else name for name in list_cases("gpt")]


@pytest.mark.parametrize("case_name", CASES)
def test_case_matches_golden_values(case_name, case_result):
    case = load_case(case_name)
    golden = load_golden(case)
    result = case_result(case_name)
    problems = compare_with_golden(case, result.metrics, golden)
    assert not problems, f"{case_name} differs from {case.golden_path}:\n" + "\n".join(problems)
    if case.test_type != "ckpt-resume":
        return
    half = case.train_iters // 2
    # Same weights, optimizer state, RNG and data position: the launch that saves and stops trains the first half
    # bit for bit as the uninterrupted run, and after loading the second half does too.
    for name, launched, iterations in (
        ("first half", result.first_half_metrics, range(1, half + 1)),
        ("resumed", result.resumed_metrics, range(half + 1, case.train_iters + 1)),
    ):
        for metric in ("lm loss", "num-zeros"):
            assert sorted(launched[metric]) == list(iterations), (name, metric)
            uninterrupted = {i: v for i, v in result.metrics[metric].items() if i in iterations}
            problems += compare_series(f"{metric} ({name})", uninterrupted, launched[metric], rtol=0.0)
    assert not problems, "\n".join(problems)

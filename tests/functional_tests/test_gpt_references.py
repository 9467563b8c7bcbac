"""Every golden case trains as its independent reference does (see `references.py`): same model, data and steps,
so the same loss per iteration.

The bound is 1e-5 relative. Layouts and sharding change only the order of floating-point sums (gradients reduced
over data-parallel ranks or shards, row-parallel outputs and the vocabulary-parallel softmax summed over
tensor-parallel ranks), which moves fp32 results by ~1e-7 relative per step; over 10 Adam steps that stays well
below 1e-5 (measured: up to ~2e-8), while a real bug (a missing or doubled reduction, a wrong loss scale or data
shard) moves the loss by 1e-4 or more within a few iterations. Pipeline layouts start from the single-rank weights
because every module draws its initial weights from a seed derived from `--seed` and its identity in the whole
model, not from the generator state of the stage building it.
"""

import pytest

from tests.functional_tests import references
from tests.functional_tests.runner import ABSOLUTE_TOLERANCE, compare_series, list_cases, load_case

RELATIVE_TOLERANCE = 1e-5
# Accidental exact zeros of a summation order (see runner.py); compared where the reference is data parallel too.
ACCIDENTAL_ZEROS_TOLERANCE = ABSOLUTE_TOLERANCE["num-zeros"]


def test_every_golden_case_has_a_reference():
    cases = set(list_cases("gpt"))
    assert references.ROOT_CASE in cases and references.ROOT_CASE not in references.REFERENCES
    missing = cases - {references.ROOT_CASE} - set(references.REFERENCES)
    assert not missing, f"golden cases without a reference run in references.REFERENCES: {sorted(missing)}"
    assert set(references.REFERENCES) <= cases, sorted(set(references.REFERENCES) - cases)
    kinds = {references.DDP_TWIN, references.SINGLE_RANK_TWIN}
    for case_name, reference in references.REFERENCES.items():
        assert reference in kinds or reference in references.ALLOWED_DIFFERENCES, (case_name, reference)
        if reference == references.DDP_TWIN:
            assert references.differing_flags(load_case(case_name), references.ddp_twin(load_case(case_name))), (
                f"{case_name} has no FSDP flag: its DDP twin would be itself")


def _allowed_differences(case_name):
    reference = references.REFERENCES[case_name]
    if reference == references.DDP_TWIN:
        return (set(references.FSDP_FLAGS) | set(references.CONTEXT_PARALLEL_FLAGS)
                | set(references.EXPERT_PARALLEL_FLAGS))
    if reference == references.SINGLE_RANK_TWIN:
        return set(references.LAYOUT_FLAGS)
    return references.ALLOWED_DIFFERENCES[reference]


CASES = [pytest.param(name, marks=pytest.mark.slow) if load_case(name).nproc_per_node > 2 else name
         for name in sorted(references.REFERENCES)]


@pytest.mark.parametrize("case_name", CASES)
def test_case_trains_as_its_reference(case_name, runs):
    case = load_case(case_name)
    reference_case, reference = runs.reference(case_name)
    differing = references.differing_flags(case, reference_case)
    allowed = _allowed_differences(case_name)
    assert differing <= allowed, f"{case_name} trains another model than its reference: {sorted(differing - allowed)}"
    resumed_differently = set(case.resume_model_args) - allowed
    assert not resumed_differently, f"{case_name} resumes another model: {sorted(resumed_differently)}"
    assert reference_case.train_iters == case.train_iters

    result = runs.case(case_name)
    launches = {"uninterrupted": result.metrics}
    if case.test_type == "ckpt-resume":
        launches["resumed"] = result.resumed_metrics
    compare_zeros = reference_case.nproc_per_node > 1 and "--log-num-zeros-in-grad" in reference_case.model_args
    problems = []
    assert sorted(reference["lm loss"]) == list(range(1, case.train_iters + 1))
    for name, metrics in launches.items():
        expected = {i: v for i, v in reference["lm loss"].items() if i in metrics["lm loss"]}
        assert len(expected) >= case.train_iters // 2, (name, sorted(metrics["lm loss"]))
        problems += compare_series(f"lm loss ({name})", expected, metrics["lm loss"], rtol=RELATIVE_TOLERANCE)
        if compare_zeros:
            expected = {i: v for i, v in reference["num-zeros"].items() if i in metrics["num-zeros"]}
            problems += compare_series(f"num-zeros ({name})", expected, metrics["num-zeros"], rtol=0.0,
                                       atol=ACCIDENTAL_ZEROS_TOLERANCE)
    assert not problems, f"{case_name} vs {reference_case.name}:\n" + "\n".join(problems)

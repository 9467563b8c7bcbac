"""Every parallel layout trains the same model as one rank does: same global batch, same data order, dropout
off, so the loss per iteration must match the single-rank run's.

The bound is 1e-5 relative. Layouts change only the order of floating-point sums (gradients reduced over two
data-parallel ranks, row-parallel outputs and the vocabulary-parallel softmax summed over two tensor-parallel
ranks), which moves fp32 results by ~1e-7 relative per step; over 10 Adam steps that stays well below 1e-5
(measured: up to ~2e-8), while a real bug (a missing or doubled reduction, a wrong loss scale or data shard)
moves the loss by 1e-4 or more within a few iterations. Pipeline layouts start from the single-rank weights
because every module draws its initial weights from a seed derived from `--seed` and its identity in the whole
model, not from the generator state of the stage building it.
"""

import pytest

from tests.functional_tests.runner import compare_series, load_case

REFERENCE_CASE = "gpt/single_rank"
LAYOUT_FLAGS = {"--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--use-distributed-optimizer"}
RELATIVE_TOLERANCE = 1e-5

LAYOUTS = [
    "gpt/dp2_ddp",
    "gpt/dp2_distributed_optimizer",
    "gpt/tp2",
    "gpt/pp2",
    pytest.param("gpt/tp2_pp2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("case_name", LAYOUTS)
def test_layout_reproduces_single_rank_loss(case_name, case_result):
    reference, layout = load_case(REFERENCE_CASE), load_case(case_name)
    differing = {
        flag
        for flag in set(reference.model_args) | set(layout.model_args)
        if reference.model_args.get(flag) != layout.model_args.get(flag)
    }
    assert differing <= LAYOUT_FLAGS, f"{case_name} changes more than the layout: {sorted(differing - LAYOUT_FLAGS)}"
    expected = case_result(REFERENCE_CASE).metrics["lm loss"]
    actual = case_result(case_name).metrics["lm loss"]
    assert sorted(actual) == sorted(expected)
    problems = compare_series("lm loss", expected, actual, rtol=RELATIVE_TOLERANCE)
    assert not problems, f"{case_name} vs {REFERENCE_CASE}:\n" + "\n".join(problems)

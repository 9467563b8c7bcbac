"""Each GPT case trains as its golden values say (loss per iteration, zero-gradient counts, memory), and the
checkpoint-resume case continues exactly where the uninterrupted run was."""

import pytest

from tests.functional_tests.runner import compare_series, compare_with_golden, list_cases, load_case, load_golden

FAST_CASES = [
    "gpt/single_rank",
    "gpt/dp2_ddp",
    "gpt/dp2_distributed_optimizer",
    "gpt/tp2",
    "gpt/pp2",
    "gpt/llama_style_tp2",
    "gpt/fsdp2_dp2",
    "gpt/fsdp2_no_reshard_dp2",
    "gpt/megatron_fsdp_z1_dp2",
    "gpt/megatron_fsdp_z2_dp2",
    "gpt/megatron_fsdp_z3_dp2",
    "gpt/megatron_fsdp_z3_meta_init_dp2",
    "gpt/megatron_fsdp_z3_double_buffer_dp2",
]
# Four or eight ranks on two cores, and the three launches of a resume case, take longer.
SLOW_CASES = [
    "gpt/tp2_pp2",
    "gpt/resume_dp2_distributed_optimizer",
    "gpt/resume_megatron_fsdp_z3_dp2_async",
    "gpt/resume_fsdp2_dp2",
    "gpt/resume_dp2_ddp",
    "gpt/resume_megatron_fsdp_z0_dp2",
    "gpt/resume_megatron_fsdp_z1_dp2",
    "gpt/resume_megatron_fsdp_z2_dp2",
    "gpt/resume_megatron_fsdp_hsdp_dp4",
    "gpt/resume_megatron_fsdp_hfsdp_dp4",
    "gpt/fsdp2_tp2_dp2",
    "gpt/megatron_fsdp_z3_tp2_sp_dp2",
    "gpt/megatron_fsdp_z3_pp2_dp2",
    "gpt/megatron_fsdp_z3_tp2_pp2_dp2",
    "gpt/megatron_fsdp_hsdp_dp4",
    "gpt/megatron_fsdp_hfsdp_dp4",
]


def test_every_case_folder_is_tested():
    assert sorted(FAST_CASES + SLOW_CASES) == list_cases("gpt")


@pytest.mark.parametrize(
    "case_name", FAST_CASES + [pytest.param(name, marks=pytest.mark.slow) for name in SLOW_CASES]
)
def test_case_matches_golden_values(case_name, case_result):
    case = load_case(case_name)
    golden = load_golden(case)
    result = case_result(case_name)
    problems = compare_with_golden(case, result.metrics, golden)
    assert not problems, f"{case_name} differs from {case.golden_path}:\n" + "\n".join(problems)
    if case.test_type == "ckpt-resume":
        half = case.train_iters // 2
        uninterrupted = {i: v for i, v in result.metrics["lm loss"].items() if i > half}
        resumed = result.resumed_metrics["lm loss"]
        assert sorted(resumed) == list(range(half + 1, case.train_iters + 1))
        # Same weights, optimizer state, RNG and data position after loading: the losses are bit-identical.
        problems = compare_series("lm loss (resumed)", uninterrupted, resumed, rtol=0.0)
        problems += compare_series(
            "num-zeros (resumed)",
            {i: v for i, v in result.metrics["num-zeros"].items() if i > half},
            result.resumed_metrics["num-zeros"],
            rtol=0.0,
        )
        assert not problems, "\n".join(problems)

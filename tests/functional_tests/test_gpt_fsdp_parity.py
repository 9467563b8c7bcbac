"""Every FSDP case (PyTorch FSDP2, Megatron-FSDP) trains exactly as Megatron DDP does with the same model, data,
TP/PP layout and steps (its "DDP twin": the case without its FSDP flags), while each rank holds less state.

Losses, gradient norms and parameter norms agree within 1e-5 relative: sharding changes only the order of the
floating-point sums of the gradient reduction (~1e-7 per step, measured identical to the last bit for FSDP2 on
this machine), while a wrong reduction or scale moves them by 1e-4 or more. Zero counts may differ by the
accidental exact zeros of a summation order (a few per step; see runner.py); the structural ones (embedding
rows of tokens not in the batch, thousands) must agree. Per-rank bytes follow the sharding theory exactly.
"""

import pytest

from tests.functional_tests import test_gpt_golden_values as golden_values_test
from tests.functional_tests.conftest import FSDP_FLAGS
from tests.functional_tests.runner import compare_series, list_cases, load_case, load_golden

RELATIVE_TOLERANCE = 1e-5
ACCIDENTAL_ZEROS_TOLERANCE = 4.0

# case -> over how many ranks each kind of per-rank state is split: (parameters, gradients, optimizer state).
# ZeRO-1 shards the optimizer state, ZeRO-2 also gradients, ZeRO-3 / FSDP2 also parameters; HSDP shards over
# the 2 ranks of an instance and replicates across instances; HFSDP also shards the optimizer state, and the
# gradients that feed it, across the instances.
SHARDED_OVER = {
    "gpt/fsdp2_dp2": (2, 2, 2),
    "gpt/fsdp2_no_reshard_dp2": (2, 2, 2),
    "gpt/fsdp2_tp2_dp2": (2, 2, 2),
    "gpt/megatron_fsdp_z1_dp2": (1, 1, 2),
    "gpt/megatron_fsdp_z2_dp2": (1, 2, 2),
    "gpt/megatron_fsdp_z3_dp2": (2, 2, 2),
    "gpt/megatron_fsdp_z3_meta_init_dp2": (2, 2, 2),
    "gpt/megatron_fsdp_z3_double_buffer_dp2": (2, 2, 2),
    "gpt/megatron_fsdp_z3_tp2_sp_dp2": (2, 2, 2),
    "gpt/megatron_fsdp_z3_pp2_dp2": (2, 2, 2),
    "gpt/megatron_fsdp_z3_tp2_pp2_dp2": (2, 2, 2),
    "gpt/megatron_fsdp_hsdp_dp4": (2, 2, 2),
    "gpt/megatron_fsdp_hfsdp_dp4": (2, 4, 4),
}
# Cases whose fp32 main weights are a separate copy of the optimizer's shard rather than the compute weights
# themselves: HFSDP stores its quarter of the main weights apart from the compute half it belongs to.
SEPARATE_MAIN_WEIGHTS = {
    "gpt/megatron_fsdp_hfsdp_dp4",
}
# The golden-value test's slow cases (more than two ranks on two cores).
SLOW_CASES = set(golden_values_test.SLOW_CASES) & set(SHARDED_OVER)
CASES = [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_CASES else name for name in SHARDED_OVER]


def _per_rank_bytes(metrics):
    return {name: metrics[name][1] for name in ("params-bytes", "grads-bytes", "optimizer-state-bytes")}


@pytest.mark.parametrize("case_name", CASES)
def test_fsdp_case_trains_as_its_ddp_twin(case_name, case_result, ddp_twin_result):
    case = load_case(case_name)
    fsdp, ddp = case_result(case_name).metrics, ddp_twin_result(case_name).metrics
    problems = []
    for metric in ("lm loss", "grad norm", "params-norm"):
        assert len(ddp[metric]) == case.train_iters, metric
        problems += compare_series(metric, ddp[metric], fsdp[metric], rtol=RELATIVE_TOLERANCE)
    problems += compare_series("num-zeros", ddp["num-zeros"], fsdp["num-zeros"], rtol=0.0,
                               atol=ACCIDENTAL_ZEROS_TOLERANCE)
    assert not problems, f"{case_name} vs its DDP twin:\n" + "\n".join(problems)

    # Sharded state is split evenly (every sharded size of this model divides evenly), replicated state is
    # whole. Adam's state is two moments per element plus one 4-byte step counter per parameter, which no
    # strategy shards; fp32 main weights are the compute weights (or a slice of them) unless listed above.
    params_over, grads_over, optimizer_over = SHARDED_OVER[case_name]
    fsdp_bytes, ddp_bytes = _per_rank_bytes(fsdp), _per_rank_bytes(ddp)
    full_params = ddp_bytes["params-bytes"]
    step_counters = ddp_bytes["optimizer-state-bytes"] - 2 * full_params
    assert 0 < step_counters < 1000
    assert fsdp_bytes["params-bytes"] == full_params // params_over
    assert fsdp_bytes["grads-bytes"] == ddp_bytes["grads-bytes"] // grads_over
    main_weights_copies = 1 if case_name in SEPARATE_MAIN_WEIGHTS else 0
    expected_optimizer_bytes = (2 + main_weights_copies) * (full_params // optimizer_over) + step_counters
    assert fsdp_bytes["optimizer-state-bytes"] == expected_optimizer_bytes


def test_every_fsdp_case_folder_has_a_ddp_twin_check():
    # Resume cases compare a run with itself interrupted; their FSDP twin checks are the uninterrupted cases'.
    fsdp_cases = [name for name in list_cases("gpt") if "fsdp" in name and load_case(name).test_type == "regular"]
    assert sorted(fsdp_cases) == sorted(SHARDED_OVER)
    assert SEPARATE_MAIN_WEIGHTS <= set(SHARDED_OVER)


# Resume case -> the Megatron DDP case that trains the same model on the same data for the same steps. Their
# golden values are compared, at no cost in runs: the golden-value test holds every run to its golden losses
# within 1e-6, so a resume case's training is held to DDP's through its golden file, and regenerating the golden
# values of a wrapper that drifted from DDP fails here. resume_fsdp2_dp2 trains an untied model no DDP case has.
RESUME_DDP_REFERENCE = {
    "gpt/resume_dp2_distributed_optimizer": "gpt/resume_dp2_ddp",
    "gpt/resume_megatron_fsdp_z0_dp2": "gpt/resume_dp2_ddp",
    "gpt/resume_megatron_fsdp_z1_dp2": "gpt/resume_dp2_ddp",
    "gpt/resume_megatron_fsdp_z2_dp2": "gpt/resume_dp2_ddp",
    "gpt/resume_megatron_fsdp_z3_dp2_async": "gpt/resume_dp2_ddp",
    "gpt/resume_megatron_fsdp_hsdp_dp4": "gpt/dp2_ddp",
    "gpt/resume_megatron_fsdp_hfsdp_dp4": "gpt/dp2_ddp",
}
# Flags that change how a run is checkpointed or what it logs, not what it trains.
NON_TRAINING_FLAGS = ("--ckpt-format", "--async-save", "--use-persistent-ckpt-worker", "--log-params-norm")


@pytest.mark.parametrize("case_name", sorted(RESUME_DDP_REFERENCE))
def test_resume_case_golden_values_equal_ddp_ones(case_name):
    case, reference = load_case(case_name), load_case(RESUME_DDP_REFERENCE[case_name])
    differing = {
        flag
        for flag in set(case.model_args) | set(reference.model_args)
        if case.model_args.get(flag) != reference.model_args.get(flag)
    }
    allowed = set(FSDP_FLAGS) | set(NON_TRAINING_FLAGS)
    assert differing <= allowed, (
        f"{case_name} trains another model than {reference.name}: {sorted(differing - allowed)}"
    )
    losses, reference_losses = _golden_series(case, "lm loss"), _golden_series(reference, "lm loss")
    assert sorted(losses) == sorted(reference_losses) == list(range(1, case.train_iters + 1))
    problems = compare_series("lm loss", reference_losses, losses, rtol=RELATIVE_TOLERANCE)
    problems += compare_series("num-zeros", _golden_series(reference, "num-zeros"), _golden_series(case, "num-zeros"),
                               rtol=0.0, atol=ACCIDENTAL_ZEROS_TOLERANCE)
    assert not problems, f"{case.golden_path} vs {reference.golden_path}:\n" + "\n".join(problems)


def _golden_series(case, metric):
    return {int(step): value for step, value in load_golden(case)[metric]["values"].items()}


def test_every_resume_case_has_a_ddp_reference():
    resume_cases = {name for name in list_cases("gpt") if load_case(name).test_type == "ckpt-resume"}
    assert resume_cases - set(RESUME_DDP_REFERENCE) == {"gpt/resume_dp2_ddp", "gpt/resume_fsdp2_dp2"}

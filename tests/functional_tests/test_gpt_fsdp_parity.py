"""Every FSDP case (PyTorch FSDP2, Megatron-FSDP) trains exactly as Megatron DDP does with the same model, data,
TP/PP layout and steps (its "DDP twin": the case without its FSDP flags), while each rank holds less state.

Losses, gradient norms and parameter norms agree within 1e-5 relative: sharding changes only the order of the
floating-point sums of the gradient reduction (~1e-7 per step, measured identical to the last bit for FSDP2 on
this machine), while a wrong reduction or scale moves them by 1e-4 or more. Zero counts may differ by the
accidental exact zeros of a summation order (a few per step; see runner.py); the structural ones (embedding
rows of tokens not in the batch, thousands) must agree. Per-rank bytes follow the sharding theory exactly.
"""

import pytest

from tests.functional_tests.runner import compare_series, load_case

RELATIVE_TOLERANCE = 1e-5
ACCIDENTAL_ZEROS_TOLERANCE = 4.0

# case -> the per-rank state it shards over data parallelism (ZeRO-3 / FSDP2: all of it).
SHARDED_STATE = {
    "gpt/fsdp2_dp2": ("params", "grads", "optimizer"),
    "gpt/fsdp2_no_reshard_dp2": ("params", "grads", "optimizer"),
    "gpt/fsdp2_tp2_dp2": ("params", "grads", "optimizer"),
}
# Four ranks on two cores take longer.
SLOW_CASES = {"gpt/fsdp2_tp2_dp2"}
CASES = [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_CASES else name for name in SHARDED_STATE]


def _data_parallel_size(case):
    model_parallel = int(case.model_args.get("--tensor-model-parallel-size", 1)) * int(
        case.model_args.get("--pipeline-model-parallel-size", 1)
    )
    return case.nproc_per_node // model_parallel


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

    # Sharded state is split evenly over the data-parallel ranks (every sharded dimension of this model is even),
    # replicated state is whole. Adam's state is two moments per element plus one 4-byte step counter per
    # parameter, which no strategy shards.
    data_parallel_size = _data_parallel_size(case)
    sharded_kinds = SHARDED_STATE[case_name]
    fsdp_bytes, ddp_bytes = _per_rank_bytes(fsdp), _per_rank_bytes(ddp)
    full_params = ddp_bytes["params-bytes"]
    step_counters = ddp_bytes["optimizer-state-bytes"] - 2 * full_params
    assert 0 < step_counters < 1000

    def expected(kind, full):
        return full // data_parallel_size if kind in sharded_kinds else full

    assert fsdp_bytes["params-bytes"] == expected("params", full_params)
    assert fsdp_bytes["grads-bytes"] == expected("grads", ddp_bytes["grads-bytes"])
    assert fsdp_bytes["optimizer-state-bytes"] == 2 * expected("optimizer", full_params) + step_counters

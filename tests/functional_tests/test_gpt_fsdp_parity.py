"""Every FSDP case (PyTorch FSDP2, Megatron-FSDP) trains exactly as Megatron DDP does with the same model, data,
TP/PP layout and steps (its "DDP twin": the case without its FSDP flags), while each rank holds less state.

Losses, gradient norms and parameter norms agree within 1e-5 relative: sharding changes only the order of the
floating-point sums of the gradient reduction (~1e-7 per step, measured identical to the last bit for FSDP2 on
this machine), while a wrong reduction or scale moves them by 1e-4 or more. Zero counts may differ by the
accidental exact zeros of a summation order (a few per step; see runner.py); the structural ones (embedding
rows of tokens not in the batch, thousands) must agree. Per-rank bytes follow the sharding theory exactly.
"""

import pytest

from tests.functional_tests import references
from tests.functional_tests.runner import ABSOLUTE_TOLERANCE, compare_series, list_cases, load_case

RELATIVE_TOLERANCE = 1e-5
# Accidental exact zeros, mostly of the attention key bias gradient (see runner.py); measured at most 5 apart from
# the DDP twin (cp2_megatron_fsdp_z3, step 1).
ACCIDENTAL_ZEROS_TOLERANCE = ABSOLUTE_TOLERANCE["num-zeros"]

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
    "gpt/megatron_fsdp_z3_overlap_dp3": (3, 3, 3),
    "gpt/megatron_fsdp_z3_tp2_sp_dp2": (2, 2, 2),
    "gpt/megatron_fsdp_z3_pp2_dp2": (2, 2, 2),
    "gpt/megatron_fsdp_z3_tp2_pp2_dp2": (2, 2, 2),
    "gpt/pp2_vpp2_megatron_fsdp_z3": (2, 2, 2),  # PP2 x DP2, two chunks per rank
    "gpt/megatron_fsdp_hsdp_dp4": (2, 2, 2),
    "gpt/megatron_fsdp_hfsdp_dp4": (2, 4, 4),
    "gpt/cp2_megatron_fsdp_z3": (2, 2, 2),  # DP1 x CP2: sharded over the dp_shard_cp group
    "gpt/deepseek_proxy_ep2_fsdp2": (2, 2, 2),  # dense over DP2, experts 1/EP2 per rank (expert-DP 1)
    "gpt/moe_megatron_fsdp_z3_dp2": (2, 2, 2),  # EP1: experts sharded with the dense parameters
    "gpt/moe_tp2_ep2_8experts_megatron_fsdp_z3": (2, 2, 2),  # dense over DP2, experts 1/EP2 per rank (expert-DP 1)
}
# Expert-parallel cases: parameter tensors of the other expert-parallel ranks' experts, which the EP1 twin holds
# and this rank does not (no Adam step counter for them): 2 MoE layers x 2 experts x fc1/fc2 weight and bias.
OTHER_RANKS_EXPERT_TENSORS = {
    "gpt/deepseek_proxy_ep2_fsdp2": 16,
    "gpt/moe_tp2_ep2_8experts_megatron_fsdp_z3": 32,  # 2 layers x 4 experts x fc1/fc2 weight and bias
}
# Cases whose fp32 main weights are a separate copy of the optimizer's shard rather than the compute weights
# themselves: HFSDP stores its quarter of the main weights apart from the compute half it belongs to.
SEPARATE_MAIN_WEIGHTS = {
    "gpt/megatron_fsdp_hfsdp_dp4",
}
# Cases whose data-parallel size does not divide every parameter's rows: each rank holds its torch.chunk share
# of each parameter's rows, which differs from 1/N by up to a row per parameter, and Megatron-FSDP's flat shards
# are padded to the largest share; measured on 3 ranks (the rank the metrics report): parameter bytes 1.5% above
# a third (padded), the optimizer's moments 3.0% below (this rank's real elements). A state left unsharded or
# split by the wrong factor is off by 50% or more.
UNEVEN_SPLIT_MARGIN = 0.05
UNEVEN_SPLIT = {
    "gpt/megatron_fsdp_z3_overlap_dp3",
}
# More than two ranks on two cores take longer.
CASES = [pytest.param(name, marks=pytest.mark.slow) if load_case(name).nproc_per_node > 2 else name
         for name in SHARDED_OVER]


def _per_rank_bytes(metrics):
    return {name: metrics[name][1] for name in ("params-bytes", "grads-bytes", "optimizer-state-bytes")}


@pytest.mark.parametrize("case_name", CASES)
def test_fsdp_case_trains_as_its_ddp_twin(case_name, runs):
    case = load_case(case_name)
    assert references.REFERENCES[case_name] == references.DDP_TWIN
    fsdp, (_, ddp) = runs.case(case_name).metrics, runs.reference(case_name)
    problems = []
    for metric in ("lm loss", "grad norm", "params-norm"):
        assert len(ddp[metric]) == case.train_iters, metric
        problems += compare_series(metric, ddp[metric], fsdp[metric], rtol=RELATIVE_TOLERANCE)
    problems += compare_series("num-zeros", ddp["num-zeros"], fsdp["num-zeros"], rtol=0.0,
                               atol=ACCIDENTAL_ZEROS_TOLERANCE)
    assert not problems, f"{case_name} vs its DDP twin:\n" + "\n".join(problems)

    # Sharded state is split evenly (every sharded size of this model divides evenly, except in UNEVEN_SPLIT),
    # replicated state is whole. Adam's state is two moments per element plus one 4-byte step counter per parameter, which no
    # strategy shards; fp32 main weights are the compute weights (or a slice of them) unless listed above.
    params_over, grads_over, optimizer_over = SHARDED_OVER[case_name]
    fsdp_bytes, ddp_bytes = _per_rank_bytes(fsdp), _per_rank_bytes(ddp)
    full_params = ddp_bytes["params-bytes"]
    step_counters = ddp_bytes["optimizer-state-bytes"] - 2 * full_params
    assert 0 < step_counters < 1000
    main_weights_copies = 1 if case_name in SEPARATE_MAIN_WEIGHTS else 0
    step_counters -= 4 * OTHER_RANKS_EXPERT_TENSORS.get(case_name, 0)
    shares = {"params-bytes": full_params / params_over, "grads-bytes": ddp_bytes["grads-bytes"] / grads_over,
              "optimizer-state-bytes": (2 + main_weights_copies) * full_params / optimizer_over}
    for name, share in shares.items():
        fixed = step_counters if name == "optimizer-state-bytes" else 0
        if case_name in UNEVEN_SPLIT:
            assert abs(fsdp_bytes[name] - fixed - share) <= UNEVEN_SPLIT_MARGIN * share, (name, share)
        else:
            assert fsdp_bytes[name] == int(share) + fixed, (name, share)


def test_every_fsdp_case_folder_has_a_ddp_twin_check():
    # Resume cases compare a run with itself interrupted and with their reference (test_gpt_references.py).
    fsdp_cases = [name for name in list_cases("gpt") if "fsdp" in name and load_case(name).test_type == "regular"]
    assert sorted(fsdp_cases) == sorted(SHARDED_OVER)
    assert SEPARATE_MAIN_WEIGHTS <= set(SHARDED_OVER)

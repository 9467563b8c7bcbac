"""The independent reference of every golden case: the run its losses are compared with.

A golden file is written by the code under test, so holding a run to it only says the behaviour did not change.
Each case is therefore also compared with a reference run of another configuration that trains the same model on
the same data for the same steps and must reach the same losses within fp32 summation-order noise:

- the layouts (data, tensor, pipeline, context parallel, the distributed optimizer) against the single-rank run;
- every fully sharded case (FSDP2, Megatron-FSDP) against its DDP twin: the case without its FSDP flags on one
  data-parallel rank and without context parallelism, i.e. Megatron DDP with the same model and TP/PP layout
  (`ddp_twin`), which also gives the per-rank bytes the sharding is checked against;
- the Llama-style TP case, the short CP2 x TP2 + SP case, the MoE EP cases and the gpt-oss- and Llama-4-style
  cases against their single-rank twins (the case on one rank);
- every checkpoint-resume case, both its uninterrupted and its resumed launches, against the reference of the
  configuration it trains (a resume in another layout, `RESUME_MODEL_ARGS`, may change only the flags its
  reference allows: it still trains the same model).

`gpt/single_rank` is the root: nothing simpler trains this model, so it is held to its golden values alone.
Runs are shared: a reference that is itself a case is that case's run, and twins are keyed by their flags.
"""

import dataclasses

ROOT_CASE = "gpt/single_rank"
DDP_TWIN = "DDP twin"
SINGLE_RANK_TWIN = "single-rank twin"

# case -> the reference run: a case name, DDP_TWIN or SINGLE_RANK_TWIN.
REFERENCES = {
    "gpt/dp2_ddp": ROOT_CASE,
    "gpt/dp2_distributed_optimizer": ROOT_CASE,
    "gpt/tp2": ROOT_CASE,
    "gpt/pp2": ROOT_CASE,
    "gpt/tp2_pp2": ROOT_CASE,
    "gpt/pp2_vpp2_distributed_optimizer": ROOT_CASE,
    "gpt/llama_style_tp2": SINGLE_RANK_TWIN,
    "gpt/fsdp2_dp2": DDP_TWIN,
    "gpt/fsdp2_no_reshard_dp2": DDP_TWIN,
    "gpt/fsdp2_tp2_dp2": DDP_TWIN,
    "gpt/megatron_fsdp_z1_dp2": DDP_TWIN,
    "gpt/megatron_fsdp_z2_dp2": DDP_TWIN,
    "gpt/megatron_fsdp_z3_dp2": DDP_TWIN,
    "gpt/megatron_fsdp_z3_meta_init_dp2": DDP_TWIN,
    "gpt/megatron_fsdp_z3_double_buffer_dp2": DDP_TWIN,
    "gpt/megatron_fsdp_z3_overlap_dp3": DDP_TWIN,
    "gpt/megatron_fsdp_z3_tp2_sp_dp2": DDP_TWIN,
    "gpt/megatron_fsdp_z3_pp2_dp2": DDP_TWIN,
    "gpt/megatron_fsdp_z3_tp2_pp2_dp2": DDP_TWIN,
    "gpt/pp2_vpp2_megatron_fsdp_z3": DDP_TWIN,
    "gpt/megatron_fsdp_hsdp_dp4": DDP_TWIN,
    "gpt/megatron_fsdp_hfsdp_dp4": DDP_TWIN,
    "gpt/resume_dp2_ddp": ROOT_CASE,
    "gpt/resume_dp2_distributed_optimizer": ROOT_CASE,
    "gpt/resume_fsdp2_dp2": DDP_TWIN,
    "gpt/resume_megatron_fsdp_z0_dp2": "gpt/dp2_ddp",
    "gpt/resume_megatron_fsdp_z1_dp2": "gpt/dp2_ddp",
    "gpt/resume_megatron_fsdp_z2_dp2": "gpt/dp2_ddp",
    "gpt/resume_megatron_fsdp_z3_dp2_async": "gpt/dp2_ddp",
    "gpt/resume_megatron_fsdp_hsdp_dp4": DDP_TWIN,
    "gpt/resume_megatron_fsdp_hfsdp_dp4": DDP_TWIN,
    "gpt/cp2_a2a": ROOT_CASE,
    "gpt/cp2_a2a_dp2": ROOT_CASE,
    "gpt/cp2_megatron_fsdp_z3": DDP_TWIN,
    "gpt/llama3_megatron_fsdp_recipe_resume_dp2": DDP_TWIN,
    "gpt/cp2_tp2_sp": SINGLE_RANK_TWIN,
    "gpt/resume_cp2_megatron_fsdp_to_cp1_ddp": DDP_TWIN,
    "gpt/resume_pp2_vpp2_to_pp2": ROOT_CASE,
    "gpt/moe_ep2_ddp": SINGLE_RANK_TWIN,
    "gpt/moe_ep2_distributed_optimizer": SINGLE_RANK_TWIN,
    "gpt/moe_ep2_tp2_sp": SINGLE_RANK_TWIN,
    "gpt/deepseek_proxy_ep2_fsdp2": DDP_TWIN,
    "gpt/moe_megatron_fsdp_z3_dp2": DDP_TWIN,
    "gpt/moe_tp2_ep2_8experts_megatron_fsdp_z3": DDP_TWIN,
    "gpt/moe_tp2_ep2_8experts_top2_megatron_fsdp_z3_resume": DDP_TWIN,
    "gpt/resume_moe_ep2_distributed_optimizer_to_ep1_ddp": SINGLE_RANK_TWIN,
    "gpt/gpt_oss_style_cp2_ep2": SINGLE_RANK_TWIN,
    "gpt/llama4_style_pp2_vpp2": SINGLE_RANK_TWIN,
}

# Flags that select or tune a fully sharded data-parallel wrapper. Without them a case trains with Megatron DDP.
FSDP_FLAGS = (
    "--use-torch-fsdp2",
    "--torch-fsdp2-no-reshard-after-forward",
    "--use-megatron-fsdp",
    "--data-parallel-sharding-strategy",
    "--outer-dp-sharding-strategy",
    "--num-distributed-optimizer-instances",
    "--init-model-with-meta-device",
    "--fsdp-double-buffer",
    "--suggested-communication-unit-size",
    "--megatron-fsdp-main-params-dtype",
    "--megatron-fsdp-main-grads-dtype",
    "--megatron-fsdp-grad-comm-dtype",
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
)
# Flags read only when a checkpoint is saved or loaded: a launch that does neither trains the same without them.
CHECKPOINT_ONLY_FLAGS = ("--ckpt-format", "--async-save", "--use-persistent-ckpt-worker",
                         "--dist-ckpt-optim-fully-reshardable", "--disable-strict-fsdp-dtensor-load")
# Flags that change what a run logs, not what it trains.
LOGGING_FLAGS = ("--log-params-norm", "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard",
                 "--timing-log-level")
# Flags that lay the same model out over ranks.
# Context parallelism cuts every sequence over ranks; attention and the loss stay exact.
CONTEXT_PARALLEL_FLAGS = ("--context-parallel-size", "--cp-comm-type", "--hierarchical-context-parallel-sizes")
# The interleaved pipeline only reorders the same computation over model chunks.
VIRTUAL_PIPELINE_FLAGS = ("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
                          "--microbatch-group-size-per-virtual-pipeline-stage")
# Expert parallelism spreads the same experts over ranks; dropless routing keeps every token's experts.
EXPERT_PARALLEL_FLAGS = ("--expert-model-parallel-size",)
LAYOUT_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--sequence-parallel",
                "--use-distributed-optimizer") + CONTEXT_PARALLEL_FLAGS + VIRTUAL_PIPELINE_FLAGS + EXPERT_PARALLEL_FLAGS

# What a case may change against its reference, by reference kind (checked flag by flag).
ALLOWED_DIFFERENCES = {
    ROOT_CASE: set(LAYOUT_FLAGS) | set(CHECKPOINT_ONLY_FLAGS) | set(LOGGING_FLAGS),
    "gpt/dp2_ddp": set(FSDP_FLAGS) | set(CHECKPOINT_ONLY_FLAGS) | set(LOGGING_FLAGS),
}


def ddp_twin(case):
    """`case` with every FSDP flag removed, on one data-parallel rank: the same model, data, TP/PP layout and steps
    under Megatron DDP with no data-parallel reduction at all. DDP keeps every parameter, gradient and optimizer
    state whole on each rank whatever the data-parallel size, so its per-rank bytes are those of a DDP run at the
    case's data-parallel size (the last rank logs: the same pipeline stage and tensor-parallel rank)."""
    # Context and expert parallelism go too: the twin is then also the CP=1 / EP=1 run the case must equal.
    model_args = {flag: value for flag, value in case.model_args.items()
                  if flag not in FSDP_FLAGS + CONTEXT_PARALLEL_FLAGS + EXPERT_PARALLEL_FLAGS}
    model_parallel = int(case.model_args.get("--tensor-model-parallel-size", 1)) * int(
        case.model_args.get("--pipeline-model-parallel-size", 1))
    return dataclasses.replace(case, name=f"{case.name} (DDP twin)", model_args=model_args,
                               nproc_per_node=model_parallel)


def single_rank_twin(case):
    """`case` on one rank: its layout flags removed."""
    model_args = {flag: value for flag, value in case.model_args.items() if flag not in LAYOUT_FLAGS}
    return dataclasses.replace(case, name=f"{case.name} (single-rank twin)", model_args=model_args, nproc_per_node=1)


def differing_flags(case, other):
    return {
        flag
        for flag in set(case.model_args) | set(other.model_args)
        if case.model_args.get(flag) != other.model_args.get(flag)
    }


def training_key(case):
    """Launches with equal keys train identically (same ranks, environment and training flags): one run serves
    them all. Checkpoint-only flags are left out; an uninterrupted run neither saves nor loads."""
    args = tuple(sorted((flag, str(value)) for flag, value in case.model_args.items()
                        if flag not in CHECKPOINT_ONLY_FLAGS))
    return case.nproc_per_node, tuple(sorted(case.env_vars.items())), args

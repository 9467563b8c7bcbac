"""Command-line flags of `pretrain_gpt.py`, one module per concern.

Each module offers `add_arguments(parser)` (its flags, in one argparse group) and `validate(args)` (its rules;
it may fill in derived values such as defaults computed from other flags). Errors are `ValueError`s whose
messages name the flags involved.
"""

from megatron.training.argument_groups import (
    activation_recompute,
    attention_head_transforms,
    attention_variants,
    checkpoint,
    checkpoint_args,
    communication,
    data,
    data_parallel,
    data_parallel_tuning,
    fp8,
    heterogeneous,
    hybrid,
    logging_eval,
    memory,
    mla,
    model,
    model_builders,
    moe,
    mtp,
    muon,
    numerics,
    parallelism,
    pipeline_split,
    profiling,
    qk_clip,
    resilience,
    result_validation,
    run_control,
    sft,
    training,
    upstream_compat,
    virtual_pipeline,
)

# Order matters for validation: later groups read values derived by earlier ones (e.g. data_parallel_size).
# upstream_compat comes first: it turns upstream's aliases (--encoder-seq-length, ...) into the flags the others read.
# checkpoint_args comes next: --use-checkpoint-args replaces model flags before anything is derived from them.
# memory precedes data_parallel: --main-grads-dtype bf16 opts out of the fp32 gradients data_parallel sets for --bf16.
# activation_recompute precedes training: --recompute-activations sets the granularity training's rules check.
# muon follows training (--optimizer).
# model_builders precedes model: a flag asking for another model builder stops before shape rules run.
# communication follows virtual_pipeline: its p2p rules depend on the virtual stages per rank.
# moe comes last: it validates by building the transformer config from every other group's values.
# virtual_pipeline follows training: its microbatch rule needs the global and micro batch sizes.
# pipeline_split follows virtual_pipeline: the layers must divide into the virtual stages per rank it derives.
# mtp follows pipeline_split: a layout's 'm' symbols must match --mtp-num-layers.
# sft follows data: it reads the tokenizer type data settles.
# hybrid follows model: it reads --num-layers; its pattern reaches the config moe validates.
# heterogeneous follows hybrid: it refuses hybrid patterns (and MoE, MLA, MTP) with its layers.
ARGUMENT_GROUPS = (upstream_compat, checkpoint_args, model_builders, parallelism, model, hybrid, heterogeneous, mla,
                   activation_recompute, training, muon, qk_clip, attention_variants, attention_head_transforms,
                   virtual_pipeline, pipeline_split, mtp, data, sft, logging_eval, profiling, checkpoint, memory,
                   data_parallel, communication, fp8, result_validation, numerics, data_parallel_tuning, run_control,
                   resilience, moe)

"""Command-line flags of `pretrain_gpt.py`, one module per concern.

Each module offers `add_arguments(parser)` (its flags, in one argparse group) and `validate(args)` (its rules;
it may fill in derived values such as defaults computed from other flags). Errors are `ValueError`s whose
messages name the flags involved.
"""

from megatron.training.argument_groups import (
    checkpoint,
    data,
    data_parallel,
    data_parallel_tuning,
    fp8,
    logging_eval,
    memory,
    mla,
    model,
    moe,
    numerics,
    parallelism,
    pipeline_split,
    result_validation,
    run_control,
    training,
    virtual_pipeline,
)

# Order matters for validation: later groups read values derived by earlier ones (e.g. data_parallel_size).
# memory precedes data_parallel: --main-grads-dtype bf16 opts out of the fp32 gradients data_parallel sets for --bf16.
# moe comes last: it validates by building the transformer config from every other group's values.
# virtual_pipeline follows training: its microbatch rule needs the global and micro batch sizes.
# pipeline_split follows virtual_pipeline: the layers must divide into the virtual stages per rank it derives.
ARGUMENT_GROUPS = (parallelism, model, mla, training, virtual_pipeline, pipeline_split, data, logging_eval,
                   checkpoint, memory, data_parallel, fp8, result_validation, numerics, data_parallel_tuning,
                   run_control, moe)

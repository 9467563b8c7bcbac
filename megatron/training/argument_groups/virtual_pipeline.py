"""Interleaved (virtual) pipeline flags: model chunks per pipeline rank and how microbatches are grouped.

Upstream's rules: give at most one of `--num-layers-per-virtual-pipeline-stage` and
`--num-virtual-stages-per-pipeline-rank`; the layers of a pipeline stage (L / p) must divide into the virtual
stages; the microbatches of a global batch (M) must fit groups of N = `--microbatch-group-size-per-virtual-
pipeline-stage` (default p): p <= N <= M and M mod N is 0 or at least p. One virtual stage per rank is the plain
1F1B pipeline (`args.virtual_pipeline_model_parallel_size` is then None). Each chunk is wrapped on its own (DDP,
the distributed optimizer, Megatron-FSDP or FSDP2); one optimizer steps them all.
"""

from megatron.core.pipeline_parallel.interleaved_plan import check_microbatches

LAYERS_FLAG = "--num-layers-per-virtual-pipeline-stage"
STAGES_FLAG = "--num-virtual-stages-per-pipeline-rank"
GROUP_FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"


def add_arguments(parser):
    group = parser.add_argument_group("virtual pipeline")
    group.add_argument(
        LAYERS_FLAG, type=int, default=None,
        help="Layers per virtual pipeline stage (model chunk): interleaved 1F1B with (layers per pipeline stage) / "
        "this many chunks per pipeline rank.",
    )
    group.add_argument(
        STAGES_FLAG, type=int, default=None,
        help="Virtual pipeline stages (model chunks) per pipeline rank: interleaved 1F1B.",
    )
    group.add_argument(
        GROUP_FLAG, type=int, default=None,
        help="Consecutive microbatches each model chunk runs before the next chunk (default: the pipeline size).",
    )


def validate(args):
    layers, stages = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    args.virtual_pipeline_model_parallel_size = None
    if layers is None and stages is None:
        if args.microbatch_group_size_per_virtual_pipeline_stage is not None:
            raise ValueError(f"{GROUP_FLAG} needs an interleaved pipeline: set {LAYERS_FLAG} or {STAGES_FLAG}")
        return
    if layers is not None and stages is not None:
        raise ValueError(f"give either {LAYERS_FLAG} or {STAGES_FLAG}, not both")
    pp = args.pipeline_model_parallel_size
    if pp < 2:
        raise ValueError(f"{LAYERS_FLAG} / {STAGES_FLAG} need --pipeline-model-parallel-size > 1, got {pp}")
    if args.num_layers % pp != 0:
        raise ValueError(f"--num-layers ({args.num_layers}) must be divisible by --pipeline-model-parallel-size ({pp})")
    layers_per_stage = args.num_layers // pp
    if layers is not None:
        if layers < 1 or layers_per_stage % layers != 0:
            raise ValueError(
                f"the {layers_per_stage} layers of a pipeline stage (--num-layers {args.num_layers} / "
                f"--pipeline-model-parallel-size {pp}) must be divisible by {LAYERS_FLAG} ({layers})"
            )
        stages = layers_per_stage // layers
    elif stages < 1 or layers_per_stage % stages != 0:
        raise ValueError(
            f"the {layers_per_stage} layers of a pipeline stage (--num-layers {args.num_layers} / "
            f"--pipeline-model-parallel-size {pp}) must be divisible by {STAGES_FLAG} ({stages})"
        )
    if stages == 1:
        if args.microbatch_group_size_per_virtual_pipeline_stage is not None:
            raise ValueError(f"{GROUP_FLAG} needs at least two virtual stages per pipeline rank")
        return  # one chunk per rank: plain 1F1B
    args.virtual_pipeline_model_parallel_size = stages
    group_size = args.microbatch_group_size_per_virtual_pipeline_stage
    if group_size is None:
        group_size = pp
    num_microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    check_microbatches(num_microbatches, pp, group_size)

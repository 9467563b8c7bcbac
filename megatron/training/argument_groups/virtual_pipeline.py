"""Interleaved (virtual) pipeline flags: model chunks per pipeline rank and how microbatches are grouped.

Upstream's rules: give at most one of `--num-layers-per-virtual-pipeline-stage` and
`--num-virtual-stages-per-pipeline-rank`; `--pipeline-model-parallel-layout` sets the virtual stages per rank
itself (its stage count / p), and either flag given with it must agree; the layers of a pipeline stage
(L / p, or what the uneven-split flags of `pipeline_split` give it) must divide into the virtual stages; the
microbatches of a global batch (M) must fit groups of N = `--microbatch-group-size-per-virtual-pipeline-stage`
(default p): p <= N <= M and M mod N is 0 or at least p; without an interleaved pipeline N is ignored (with a
warning), as upstream. One virtual stage per rank is the plain 1F1B pipeline
(`args.virtual_pipeline_model_parallel_size` is then None). Each chunk is wrapped on its own (DDP, the distributed
optimizer, Megatron-FSDP or FSDP2); one optimizer steps them all.
"""

import warnings

from megatron.core.pipeline_parallel.interleaved_plan import check_microbatches
from megatron.core.transformer.pipeline_parallel_layer_layout import LAYOUT_FLAG
from megatron.core.transformer.pipeline_split import FIRST_FLAG, LAST_FLAG, virtual_stage_layer_counts
from megatron.training.argument_groups.pipeline_split import parsed_layout

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
    layout = parsed_layout(args)
    if layout is None and layers is None and stages is None:
        _group_size_unused(args)
        return
    if layers is not None and stages is not None:
        raise ValueError(f"give either {LAYERS_FLAG} or {STAGES_FLAG}, not both")
    pp = args.pipeline_model_parallel_size
    if layout is None and pp < 2:
        raise ValueError(f"{LAYERS_FLAG} / {STAGES_FLAG} need --pipeline-model-parallel-size > 1, got {pp}")
    if layers is not None:
        layers_stages = _stages_from_layers_per_stage(args, layers, layout)
        if layout is not None and layers_stages != layout.virtual_pipeline_model_parallel_size:
            _disagrees_with_layout(layout, f"{LAYERS_FLAG} {layers} gives {layers_stages}")
        stages = layers_stages
    elif stages is not None and stages < 1:
        raise ValueError(f"{STAGES_FLAG} must be at least 1, got {stages}")
    if layout is not None:
        if stages is not None and stages != layout.virtual_pipeline_model_parallel_size:
            _disagrees_with_layout(layout, f"{STAGES_FLAG} is {stages}")
        stages = layout.virtual_pipeline_model_parallel_size
        if stages > 1 and pp < 2:
            raise ValueError(f"{LAYOUT_FLAG} {layout.text!r} has {len(layout.stages)} stages: an interleaved "
                             "pipeline needs --pipeline-model-parallel-size > 1 (one stage per pipeline rank)")
    if stages == 1:
        _group_size_unused(args)
        return  # one chunk per rank: plain 1F1B
    args.virtual_pipeline_model_parallel_size = stages
    num_microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    check_microbatches(num_microbatches, pp, args.microbatch_group_size_per_virtual_pipeline_stage)


def _group_size_unused(args):
    """As upstream, the group size is accepted without an interleaved pipeline, where it changes nothing."""
    if args.microbatch_group_size_per_virtual_pipeline_stage is not None:
        warnings.warn(f"{GROUP_FLAG} has no effect without an interleaved pipeline (set {LAYERS_FLAG} or "
                      f"{STAGES_FLAG} to at least 2 virtual stages); ignoring it")


def _stages_from_layers_per_stage(args, layers, layout=None):
    """Virtual stages per rank from the layers each holds: (L + accounted embedding/loss) / p / layers. With a
    layout, a count that does not split the layers evenly disagrees with it (the layout places them)."""
    if args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None:
        raise ValueError(
            f"{LAYERS_FLAG} needs the same number of layers in every virtual stage, which {FIRST_FLAG} / "
            f"{LAST_FLAG} change: give {STAGES_FLAG} instead"
        )
    if layers < 1:
        raise ValueError(f"{LAYERS_FLAG} must be at least 1, got {layers}")
    pp = args.pipeline_model_parallel_size
    accounted = int(args.account_for_embedding_in_pipeline_split) + int(args.account_for_loss_in_pipeline_split)
    total = args.num_layers + accounted
    if layout is not None and (total % pp != 0 or (total // pp) % layers != 0):
        _disagrees_with_layout(layout, f"{LAYERS_FLAG} {layers} does not split the {total} layers (--num-layers "
                               f"{args.num_layers}) evenly into virtual stages of {layers} on each of the {pp} "
                               "pipeline ranks")
    if total % pp != 0:  # the split's own message names every flag involved
        virtual_stage_layer_counts(args.num_layers, pp,
                                   account_for_embedding=args.account_for_embedding_in_pipeline_split,
                                   account_for_loss=args.account_for_loss_in_pipeline_split)
    layers_per_stage = total // pp
    if layers_per_stage % layers != 0:
        counted = f" + {accounted} accounted" if accounted else ""
        raise ValueError(
            f"the {layers_per_stage} layers of a pipeline stage (--num-layers {args.num_layers}{counted} / "
            f"--pipeline-model-parallel-size {pp}) must be divisible by {LAYERS_FLAG} ({layers})"
        )
    return layers_per_stage // layers


def _disagrees_with_layout(layout, what):
    raise ValueError(
        f"{LAYOUT_FLAG} {layout.text!r} gives {layout.virtual_pipeline_model_parallel_size} virtual stages per "
        f"pipeline rank ({len(layout.stages)} stages / --pipeline-model-parallel-size "
        f"{layout.pipeline_model_parallel_size}) but {what}: drop the flag (the layout sets it) or make them agree"
    )

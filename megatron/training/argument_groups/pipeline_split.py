"""Uneven pipeline splits: how many transformer layers each pipeline stage holds, with upstream's flags.

Pick at most one way (upstream's rules):
- `--decoder-first-pipeline-num-layers N` / `--decoder-last-pipeline-num-layers N`: the first / last pipeline
  stage holds N layers (0 <= N <= --num-layers); the other stages share the rest evenly. Needs PP > 1. With an
  interleaved pipeline each rank's layers are split evenly over its virtual stages.
- `--account-for-embedding-in-pipeline-split` / `--account-for-loss-in-pipeline-split`: the embedding / the loss
  counts as one layer; L + extras must divide evenly over the p * v virtual stages, the first / last of which
  holds one transformer layer fewer.
- `--pipeline-model-parallel-layout`: every stage spelled out (see
  megatron/core/transformer/pipeline_parallel_layer_layout.py); its stage count sets the virtual stages per rank.

The split itself is `megatron.core.transformer.pipeline_split.virtual_stage_layer_counts`, which the model
config validates again; this group checks it at parse time and hands the flags to the config.
"""

from megatron.core.transformer.pipeline_parallel_layer_layout import LAYOUT_FLAG, PipelineParallelLayerLayout
from megatron.core.transformer.pipeline_split import (
    EMBEDDING_FLAG,
    FIRST_FLAG,
    LAST_FLAG,
    LOSS_FLAG,
    describe_virtual_stage,
    stages_without_parameters,
    virtual_stage_layer_counts,
)


def add_arguments(parser):
    group = parser.add_argument_group("pipeline split")
    group.add_argument(
        FIRST_FLAG, type=int, default=None,
        help="Transformer layers of the first pipeline stage; the stages without a count share the rest evenly.",
    )
    group.add_argument(
        LAST_FLAG, type=int, default=None,
        help="Transformer layers of the last pipeline stage; the stages without a count share the rest evenly.",
    )
    group.add_argument(
        EMBEDDING_FLAG, action="store_true",
        help="Count the embedding as one layer when splitting: the first virtual stage holds one layer fewer.",
    )
    group.add_argument(
        LOSS_FLAG, action="store_true",
        help="Count the loss (output layer) as one layer when splitting: the last virtual stage holds one layer "
        "fewer.",
    )
    group.add_argument(
        LAYOUT_FLAG, type=str, default=None,
        help="Layers of every virtual stage, in virtual-stage order, separated by '|': E embedding, t transformer "
        "layer, L loss, X*N repeats a symbol or (group); e.g. 'Ett|ttL' or 'E|t*4L'. Sets the virtual stages per "
        "pipeline rank (stages / --pipeline-model-parallel-size).",
    )


def transformer_config_kwargs(args):
    """The TransformerConfig fields (upstream's names) of these flags."""
    return dict(
        num_layers_in_first_pipeline_stage=getattr(args, "decoder_first_pipeline_num_layers", None),
        num_layers_in_last_pipeline_stage=getattr(args, "decoder_last_pipeline_num_layers", None),
        account_for_embedding_in_pipeline_split=getattr(args, "account_for_embedding_in_pipeline_split", False),
        account_for_loss_in_pipeline_split=getattr(args, "account_for_loss_in_pipeline_split", False),
        pipeline_model_parallel_layout=getattr(args, "pipeline_model_parallel_layout", None),
    )


def parsed_layout(args):
    """The layout of `--pipeline-model-parallel-layout` for this pipeline size, or None."""
    if getattr(args, "pipeline_model_parallel_layout", None) is None:
        return None
    return PipelineParallelLayerLayout(args.pipeline_model_parallel_layout, args.pipeline_model_parallel_size)


def validate(args):
    """Runs after the virtual-pipeline group has set `args.virtual_pipeline_model_parallel_size`."""
    kwargs = transformer_config_kwargs(args)
    counts = args.virtual_stage_layer_counts = virtual_stage_layer_counts(
        args.num_layers,
        args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size,
        first_stage_layers=kwargs["num_layers_in_first_pipeline_stage"],
        last_stage_layers=kwargs["num_layers_in_last_pipeline_stage"],
        account_for_embedding=kwargs["account_for_embedding_in_pipeline_split"],
        account_for_loss=kwargs["account_for_loss_in_pipeline_split"],
        layout=parsed_layout(args),
    )
    _check_stages_without_parameters(args, counts)


def _check_stages_without_parameters(args, counts):
    """A middle stage without transformer layers holds no parameter. It runs under every wrapper, Megatron-FSDP
    included (passing its input on), as long as its pipeline rank has parameters in another chunk, since the
    optimizer needs some on every rank."""
    empty = stages_without_parameters(counts)
    if not empty:
        return
    pp, chunks = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size or 1
    described = ", ".join(describe_virtual_stage(stage, pp, chunks) for stage in empty)
    idle_ranks = [rank for rank in range(pp) if all(stage in empty for stage in range(rank, pp * chunks, pp))]
    if idle_ranks:
        raise ValueError(
            f"the pipeline split leaves pipeline rank(s) {idle_ranks} without any parameter ({described}: no "
            "transformer layer), and the optimizer needs parameters on every rank: give each of them at least one "
            f"layer ({LAYOUT_FLAG}, {FIRST_FLAG} / {LAST_FLAG})"
        )

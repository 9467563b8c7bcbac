"""Multi-token prediction flags (DeepSeek-V3), with upstream's names and defaults: `--mtp-num-layers N` extra
prediction depths on the last pipeline stage, their mean loss scaled by `--mtp-loss-scaling-factor` (0.1) and
added to the LM loss (see megatron/core/transformer/multi_token_prediction.py); `--mtp-use-repeated-layer` runs one
shared layer at every depth.

Rules here (the config checks the value ranges again): N >= 1; rotary or no position
embeddings (`--position-embedding-type rope` or `none`, as upstream); a
`--pipeline-model-parallel-layout` must place exactly N `m` symbols, together just before the final `L`. Any
`--context-parallel-size` works: the depths shift their tokens along the whole sequence, across the ranks' chunks.
"""

from megatron.core.transformer.mtp_config import MTP_FLAG, MTP_REPEATED_FLAG, MTP_SCALE_FLAG
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout


def add_arguments(parser):
    group = parser.add_argument_group("multi-token prediction")
    group.add_argument(
        MTP_FLAG, type=int, default=None,
        help="Multi-token prediction depths after the decoder (one transformer layer each, on the last pipeline "
        "stage); depth k predicts the token k + 1 ahead. Unset: no multi-token prediction.",
    )
    group.add_argument(
        MTP_SCALE_FLAG, type=float, default=0.1,
        help="Scale of the multi-token prediction loss: this factor times the mean of the depths' losses is added "
        "to the LM loss.",
    )
    group.add_argument(
        MTP_REPEATED_FLAG, action="store_true",
        help="Build one multi-token prediction layer and run it at every depth (shared weights) instead of one "
        "layer per depth.",
    )


def validate(args):
    depths = args.mtp_num_layers
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    if depths is None:
        if getattr(args, "mtp_use_repeated_layer", False):
            raise ValueError(f"{MTP_REPEATED_FLAG} needs {MTP_FLAG} (the depths that share the layer)")
        if layout is not None and PipelineParallelLayerLayout(layout, args.pipeline_model_parallel_size
                                                              ).mtp_layer_count():
            raise ValueError(f"--pipeline-model-parallel-layout {layout!r} places multi-token-prediction depths "
                             f"('m'): add {MTP_FLAG} with their count, or remove them")
        return
    if depths < 1:
        raise ValueError(f"{MTP_FLAG} must be >= 1 (or unset for no multi-token prediction), got {depths}")
    if args.mtp_loss_scaling_factor < 0:
        raise ValueError(f"{MTP_SCALE_FLAG} must be >= 0, got {args.mtp_loss_scaling_factor}")
    if args.position_embedding_type not in ("rope", "none"):
        raise ValueError(f"{MTP_FLAG} needs --position-embedding-type rope or none (as upstream), got "
                         f"{args.position_embedding_type}")
    if layout is not None:
        PipelineParallelLayerLayout(layout, args.pipeline_model_parallel_size).validate_layer_layout(
            args.num_layers, depths)


def transformer_config_kwargs(args):
    """The multi-token prediction fields of `TransformerConfig`."""
    return dict(mtp_num_layers=getattr(args, "mtp_num_layers", None),
                mtp_loss_scaling_factor=getattr(args, "mtp_loss_scaling_factor", 0.1),
                mtp_use_repeated_layer=getattr(args, "mtp_use_repeated_layer", False))

"""How many transformer layers each virtual pipeline stage holds: the one place the split is decided.

The split is a tuple of layer counts, one per virtual stage in virtual-stage order (stage `c * p + r` is model
chunk `c` of pipeline rank `r`; without an interleaved pipeline v = 1 and stage r is rank r). Layers are numbered
globally in that order, so a stage's first layer is the sum of the counts before it (`stage_layer_range`).
Checkpoints name layers by that global number, hence load under any split.

The flags, with upstream Megatron-LM's names and rules (one way at a time):
- even (default): L / (p * v) layers per virtual stage.
- `--decoder-first-pipeline-num-layers F` / `--decoder-last-pipeline-num-layers N`: the first / last pipeline
  rank holds F / N layers (0 allowed); the other ranks split the rest evenly. With an interleaved pipeline each
  rank's layers are split evenly over its v chunks (F / v per chunk of rank 0, as upstream).
- `--account-for-embedding-in-pipeline-split` / `--account-for-loss-in-pipeline-split`: the embedding / loss
  counts as one layer: (L + extras) / (p * v) per virtual stage, one fewer on the first / last virtual stage.
- `--pipeline-model-parallel-layout`: the count of `t` in each stage of the layout (see
  `pipeline_parallel_layer_layout`); its `m` (multi-token prediction) must match `--mtp-num-layers`.
Multi-token-prediction depths are not transformer layers of the split: they always run on the last stage.

Pure arithmetic: no torch, no process groups. Errors are ValueErrors naming the flags.
"""

from typing import Optional, Sequence, Tuple

from megatron.core.transformer.pipeline_parallel_layer_layout import LAYOUT_FLAG, PipelineParallelLayerLayout

FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"
EMBEDDING_FLAG = "--account-for-embedding-in-pipeline-split"
LOSS_FLAG = "--account-for-loss-in-pipeline-split"
VPP_FLAGS = "--num-virtual-stages-per-pipeline-rank / --num-layers-per-virtual-pipeline-stage"


def virtual_stage_layer_counts(
    num_layers: int,
    pipeline_size: int,
    virtual_stages: Optional[int] = None,
    *,
    first_stage_layers: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
    account_for_embedding: bool = False,
    account_for_loss: bool = False,
    layout: Optional[PipelineParallelLayerLayout] = None,
    mtp_num_layers: Optional[int] = None,
) -> Tuple[int, ...]:
    """Transformer layers of each of the `pipeline_size * virtual_stages` virtual stages, in virtual-stage order
    (`virtual_stages` None means 1). Raises ValueError naming the flags when the split is impossible.
    `mtp_num_layers` (`--mtp-num-layers`, 0 for none) is checked against a layout's `m` count when given; the
    MTP depths themselves always sit on the last stage and are not counted here."""
    p, v = pipeline_size, virtual_stages or 1
    uneven = first_stage_layers is not None or last_stage_layers is not None
    accounted = account_for_embedding or account_for_loss
    if layout is not None:
        if uneven or accounted:
            raise ValueError(
                f"{LAYOUT_FLAG} places every layer itself: drop {FIRST_FLAG}, {LAST_FLAG}, {EMBEDDING_FLAG} and "
                f"{LOSS_FLAG}"
            )
        return _layout_counts(num_layers, p, v, layout, mtp_num_layers)
    if uneven and accounted:
        raise ValueError(
            f"{FIRST_FLAG} / {LAST_FLAG} and {EMBEDDING_FLAG} / {LOSS_FLAG} are exclusive (as upstream): count the "
            "embedding or loss into the first / last stage's layers yourself, or use one way only"
        )
    if uneven:
        return _first_last_counts(num_layers, p, v, first_stage_layers, last_stage_layers)
    return _even_counts(num_layers, p, v, int(account_for_embedding), int(account_for_loss))


def _even_counts(num_layers, p, v, embedding, loss):
    total = num_layers + embedding + loss
    if total % p != 0:
        extras = " + ".join(flag for flag, on in ((EMBEDDING_FLAG, embedding), (LOSS_FLAG, loss)) if on)
        counted = f"--num-layers ({num_layers}) + 1 for each of {extras} ({total})" if extras else (
            f"--num-layers ({num_layers})")
        raise ValueError(
            f"{counted} must be divisible by --pipeline-model-parallel-size ({p}): every stage holds the same "
            f"number of layers; or split unevenly with {FIRST_FLAG} / {LAST_FLAG} or {LAYOUT_FLAG}"
        )
    if (total // p) % v != 0:
        raise ValueError(
            f"the {total // p} layers of a pipeline stage ((--num-layers {num_layers}"
            + (f" + {embedding + loss} accounted" if embedding + loss else "")
            + f") / --pipeline-model-parallel-size {p}) must be divisible by --num-virtual-stages-per-pipeline-rank "
            f"({v}) (or the virtual stages --num-layers-per-virtual-pipeline-stage gives): every model chunk holds "
            "the same number of layers"
        )
    per_stage = total // (p * v)
    counts = [per_stage] * (p * v)
    counts[0] -= embedding
    counts[-1] -= loss
    return tuple(counts)


def _first_last_counts(num_layers, p, v, first, last):
    if p < 2:
        raise ValueError(f"{FIRST_FLAG} / {LAST_FLAG} need --pipeline-model-parallel-size > 1 (got {p})")
    for flag, value in ((FIRST_FLAG, first), (LAST_FLAG, last)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not
                                  0 <= value <= num_layers):
            raise ValueError(f"{flag} must be an integer in [0, --num-layers={num_layers}], got {value!r}")
    middle_ranks = p - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    given = " + ".join(f"{flag} ({value})" for flag, value in ((FIRST_FLAG, first), (LAST_FLAG, last))
                       if value is not None)
    if middle_layers < 0 or (middle_ranks == 0 and middle_layers != 0):
        raise ValueError(
            f"{given} must " + ("not exceed" if middle_ranks else "equal") + f" --num-layers ({num_layers})"
            + ("" if middle_ranks else f" with --pipeline-model-parallel-size {p} (no other stage takes the rest)")
        )
    if middle_ranks and middle_layers % middle_ranks != 0:
        raise ValueError(
            f"the {middle_layers} layers left by {given} of --num-layers ({num_layers}) must be divisible by the "
            f"{middle_ranks} other pipeline stages (--pipeline-model-parallel-size {p}); change the counts"
        )
    per_middle_rank = middle_layers // middle_ranks if middle_ranks else 0
    per_rank = [per_middle_rank] * p
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    if v > 1:
        for rank, (layers, what) in enumerate(zip(per_rank, _rank_descriptions(p, first, last))):
            if layers % v != 0:
                raise ValueError(
                    f"{what} holds {layers} layers, not divisible by its {v} virtual stages ({VPP_FLAGS}): "
                    "with an interleaved pipeline each rank's layers are split evenly over its model chunks"
                )
    # Chunk c of rank r is virtual stage c * p + r.
    return tuple(per_rank[stage % p] // v for stage in range(p * v))


def _rank_descriptions(p, first, last):
    for rank in range(p):
        if rank == 0 and first is not None:
            yield f"the first pipeline stage ({FIRST_FLAG})"
        elif rank == p - 1 and last is not None:
            yield f"the last pipeline stage ({LAST_FLAG})"
        else:
            yield f"pipeline stage {rank} (an even share of the rest)"


def _layout_counts(num_layers, p, v, layout, mtp_num_layers=None):
    if layout.pipeline_model_parallel_size != p:
        raise ValueError(f"{LAYOUT_FLAG} was parsed for --pipeline-model-parallel-size "
                         f"{layout.pipeline_model_parallel_size}, but the pipeline has {p} stages")
    if layout.virtual_pipeline_model_parallel_size != v:
        raise ValueError(
            f"{LAYOUT_FLAG} {layout.text!r} has {len(layout.stages)} stages, i.e. "
            f"{layout.virtual_pipeline_model_parallel_size} virtual stages per pipeline rank with "
            f"--pipeline-model-parallel-size {p}, but {VPP_FLAGS} asks for {v}; drop the virtual-pipeline flag "
            "(the layout sets it) or make them agree"
        )
    layout.validate_layer_layout(num_layers, mtp_num_layers)
    return layout.decoder_layer_counts()


def stage_layer_range(counts: Sequence[int], pipeline_size: int, pipeline_rank: int, vp_stage: int = 0):
    """(offset, count) of model chunk `vp_stage` of `pipeline_rank`: the global index of its first layer and
    how many layers it holds."""
    stage = vp_stage * pipeline_size + pipeline_rank
    return sum(counts[:stage]), counts[stage]


def layers_per_pipeline_rank(counts: Sequence[int], pipeline_size: int) -> Tuple[int, ...]:
    """Transformer layers each pipeline rank holds over all its model chunks."""
    return tuple(sum(counts[rank::pipeline_size]) for rank in range(pipeline_size))


def stages_without_parameters(counts: Sequence[int]) -> Tuple[int, ...]:
    """Virtual stages that would hold no parameter: no transformer layer, and neither the first (embedding) nor
    the last (output layer) virtual stage."""
    return tuple(stage for stage, count in enumerate(counts) if count == 0 and 0 < stage < len(counts) - 1)


def describe_virtual_stage(stage: int, pipeline_size: int, virtual_stages: Optional[int]) -> str:
    if (virtual_stages or 1) == 1:
        return f"pipeline stage {stage}"
    return f"virtual stage {stage} (chunk {stage // pipeline_size} of pipeline rank {stage % pipeline_size})"


def split_of_config(config) -> Tuple[int, ...]:
    """`virtual_stage_layer_counts` for a TransformerConfig (its fields carry upstream's config names)."""
    return virtual_stage_layer_counts(
        config.num_layers,
        config.pipeline_model_parallel_size,
        getattr(config, "virtual_pipeline_model_parallel_size", None),
        first_stage_layers=getattr(config, "num_layers_in_first_pipeline_stage", None),
        last_stage_layers=getattr(config, "num_layers_in_last_pipeline_stage", None),
        account_for_embedding=getattr(config, "account_for_embedding_in_pipeline_split", False),
        account_for_loss=getattr(config, "account_for_loss_in_pipeline_split", False),
        layout=getattr(config, "pipeline_model_parallel_layout", None),
        mtp_num_layers=getattr(config, "mtp_num_layers", None) or 0,
    )

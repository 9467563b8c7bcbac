"""Which layers this process's pipeline stage holds: `pipeline_split`'s arithmetic applied to the initialised
pipeline group (or to a pipeline rank given explicitly)."""

from typing import Optional

from megatron.core import parallel_state
from megatron.core.transformer.pipeline_split import split_of_config, stage_layer_range


def pipeline_stage_layer_range(config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None):
    """(offset, count): the 0-based global index of this stage's first layer and how many layers it holds.

    The split is `pipeline_split.split_of_config(config)`: even (L / (p * v) per virtual stage), or uneven by
    `--decoder-first/last-pipeline-num-layers`, `--account-for-embedding/loss-in-pipeline-split` or
    `--pipeline-model-parallel-layout`. With `v` virtual stages per pipeline rank
    (`config.virtual_pipeline_model_parallel_size`), model chunk `c` of pipeline rank `r` is virtual stage
    `c * p + r` and starts after the layers of every virtual stage before it; the chunk is `vp_stage`, else the
    virtual pipeline rank being built (`set_virtual_pipeline_model_parallel_rank`). `pp_rank`: the pipeline rank
    (None: this process's; given, the config's pipeline size is used, so no pipeline group is needed).
    """
    if pp_rank is None:
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        if pp_size != config.pipeline_model_parallel_size:
            raise ValueError(
                f"--pipeline-model-parallel-size in the config ({config.pipeline_model_parallel_size}) differs from "
                f"the initialised pipeline group size ({pp_size}); build the config with the same size"
            )
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    else:
        pp_size = config.pipeline_model_parallel_size
        if not 0 <= pp_rank < pp_size:
            raise ValueError(f"pp_rank={pp_rank} is not a pipeline rank of TransformerConfig("
                             f"pipeline_model_parallel_size={pp_size}): pass 0..{pp_size - 1}")
    num_chunks = getattr(config, "virtual_pipeline_model_parallel_size", None) or 1
    if num_chunks == 1:
        vp_stage = 0
    else:
        if vp_stage is None:
            vp_stage = parallel_state.get_virtual_pipeline_model_parallel_rank()
        if vp_stage is None or not 0 <= vp_stage < num_chunks:
            raise ValueError(
                f"a model chunk of an interleaved pipeline ({num_chunks} virtual stages per pipeline rank) needs "
                f"its chunk index: pass vp_stage or set_virtual_pipeline_model_parallel_rank() (got {vp_stage!r})"
            )
    return stage_layer_range(split_of_config(config), pp_size, pp_rank, vp_stage)

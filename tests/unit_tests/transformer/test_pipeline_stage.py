"""`pipeline_stage_layer_range` of an explicitly named pipeline rank needs no pipeline group."""

import pytest

from megatron.core.transformer.pipeline_stage import pipeline_stage_layer_range
from megatron.core.transformer.transformer_config import TransformerConfig


def _config(**overrides):
    return TransformerConfig(num_layers=6, hidden_size=8, num_attention_heads=2, **overrides)


def test_named_pipeline_rank_uses_the_config_split():
    config = _config(pipeline_model_parallel_size=2)
    assert [pipeline_stage_layer_range(config, pp_rank=rank) for rank in (0, 1)] == [(0, 3), (3, 3)]
    uneven = _config(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=2)
    assert pipeline_stage_layer_range(uneven, pp_rank=1) == (2, 4)
    with pytest.raises(ValueError, match=r"pp_rank=2 is not a pipeline rank of TransformerConfig\("
                                         r"pipeline_model_parallel_size=2\): pass 0..1"):
        pipeline_stage_layer_range(config, pp_rank=2)
    with pytest.raises(ValueError, match="differs from the initialised pipeline group size"):
        pipeline_stage_layer_range(config)  # no pipeline group of 2 here

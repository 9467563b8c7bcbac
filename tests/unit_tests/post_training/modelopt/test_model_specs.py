"""megatron.core.post_training.modelopt.gpt.model_specs: `get_gpt_modelopt_spec` (what modelopt's EAGLE plugin
builds its draft layers from) says that EAGLE is unsupported, why, and what to use instead; each reason it gives
is checked against this code base, so the message changes when one stops holding."""

import dataclasses

import pytest
import torch

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.post_training.modelopt.gpt.model_specs import get_gpt_modelopt_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig


def test_the_spec_builder_says_what_is_unsupported_and_what_to_use_instead():
    with pytest.raises(NotImplementedError) as raised:
        get_gpt_modelopt_spec(None, remap_te_layernorm=True, use_arbitrary_attention_mask=True)
    message = str(raised.value)
    for part in ("EAGLE speculative decoding", "is not supported", "TransformerBlock only checks a spec",
                 "assigns transformer_layer_spec, seq_length", "frozen", "get_rotary_seq_len",
                 "examples/post_training/distill.py",
                 "convert_checkpoint.py --to hf", "hf_eagle"):
        assert part in message, part


def test_the_reasons_given_hold():
    fields = {field.name for field in dataclasses.fields(TransformerConfig)}
    assert TransformerConfig.__dataclass_params__.frozen
    assert "transformer_layer_spec" not in fields and "seq_length" not in fields
    with pytest.raises(AttributeError, match="dataclasses.replace"):  # EAGLE's conversion assigns fields after building
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2).hidden_size = 16
    # A spec of other layer modules (as EAGLE's draft layers) is refused, not built.
    with pytest.raises(TypeError, match="transformer_layer_spec must come from get_gpt_layer_local_spec"):
        TransformerBlock(TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2),
                         ModuleSpec(module=torch.nn.Linear))
    assert not hasattr(RotaryEmbedding, "get_rotary_seq_len")
    block = TransformerBlock(TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2))
    with pytest.raises(ValueError, match=r"packed_seq_params=...\) is not supported"):  # packed sequences
        block(torch.zeros(2, 1, 8), packed_seq_params=object())

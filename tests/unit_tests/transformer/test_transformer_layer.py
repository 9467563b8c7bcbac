"""TransformerLayer takes upstream's (config, submodules, layer_number, hidden_dropout, ...) arguments."""

import pytest
import torch

from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_layer import TransformerLayer
from tests.unit_tests.models.gpt.gpt_test_utils import tiny_config


def _hidden():
    return torch.randn(4, 2, 32, generator=torch.Generator().manual_seed(3))


def test_upstream_positional_order_builds_the_same_layer():
    config = tiny_config(hidden_dropout=0.0)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    reference = TransformerLayer(config, layer_number=2).state_dict()
    spec = get_gpt_layer_local_spec()
    for layer in (TransformerLayer(config, spec.submodules, 2),
                  TransformerLayer(config, spec.submodules, 2, None, None, None)):
        assert layer.layer_number == 2
        state = layer.state_dict()
        assert state.keys() == reference.keys()
        assert all(torch.equal(state[name], reference[name]) for name in reference)


def test_hidden_dropout_argument_overrides_the_config():
    config = tiny_config(hidden_dropout=0.0)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    x = _hidden()
    kept = TransformerLayer(config, None, 1).train()
    assert kept.hidden_dropout.p == 0.0 and not torch.allclose(kept(x)[0], x)
    dropped = TransformerLayer(config, None, 1, hidden_dropout=1.0).train()
    assert dropped.hidden_dropout.p == 1.0
    torch.testing.assert_close(dropped(x)[0], x)  # both sublayer outputs dropped: the residual stream alone


def test_arguments_this_layer_cannot_honour_are_refused_by_name():
    config = tiny_config()
    with pytest.raises(TypeError, match=r"second argument is upstream's submodules; pass the layer number by "
                                        r"keyword \(layer_number=3\)"):
        TransformerLayer(config, 3)
    with pytest.raises(TypeError, match=r"TransformerLayer\(submodules=ModuleSpec\(.*pass spec.submodules \(None\)"):
        TransformerLayer(config, get_gpt_layer_local_spec())
    with pytest.raises(ValueError, match=r"TransformerLayer\(pg_collection=...\) is not supported here"):
        TransformerLayer(config, None, 1, pg_collection=object())
    with pytest.raises(ValueError, match=r"TransformerLayer\(vp_stage=...\) is not supported here"):
        TransformerLayer(config, None, 1, vp_stage=0)


def test_forward_takes_upstream_arguments_and_returns_output_and_context():
    """Upstream: forward(hidden_states, attention_mask, context, context_mask, rotary_pos_emb, ...) returns
    `(hidden_states, context)`; a decoder layer's context is None."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    tensor_parallel.model_parallel_cuda_manual_seed(5)
    layer = TransformerLayer(tiny_config(), None, 1).eval()
    x = _hidden()
    angles = RotaryEmbedding(8)(x.shape[0])
    mask = torch.ones(x.shape[0], x.shape[0], dtype=torch.bool).triu(1)  # causal, True where masked
    with torch.no_grad():
        output, context = layer(x, mask, None, None, angles)  # upstream's positional order
        keyword_output, _ = layer(hidden_states=x, attention_mask=None, rotary_pos_emb=angles)
        attention_input = layer.input_layernorm(x)
        attention_output, attention_bias = layer.self_attention(attention_input, rotary_pos_emb=angles)
        middle = x + attention_output + attention_bias
        mlp_output, mlp_bias = layer.mlp(layer.pre_mlp_layernorm(middle))
    assert context is None
    torch.testing.assert_close(output, middle + mlp_output + mlp_bias)
    torch.testing.assert_close(keyword_output, output)  # attention_mask None is causal too
    assert not torch.allclose(layer(x)[0], output)  # the rotary angles matter
    for name in ("context", "context_mask", "attention_bias", "sequence_len_offset", "rotary_pos_cos"):
        with pytest.raises(ValueError, match=rf"TransformerLayer.forward\({name}=...\) is not supported: .* "
                                             rf"pass {name}=None"):
            layer(x, **{name: torch.zeros(1)})

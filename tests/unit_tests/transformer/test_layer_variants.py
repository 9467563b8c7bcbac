"""Layer variants of upstream recipes against formulas written here: the QKV bias alone (Qwen2), interleaved and
interpolated RoPE, the post-layernorm residual, the fp32 residual under bf16, GPT-2's tanh GeLU, and CPU
initialisation (same weights)."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding, apply_rotary_pos_emb
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.transformer.utils import openai_gelu
from tests.unit_tests.models.gpt.gpt_test_utils import fixed_batch, seeded_model, tiny_config

SEQ, BATCH, HIDDEN = 6, 2, 32


def _hidden(dtype=torch.float32):
    return torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(11)).to(dtype)


def _summed(output_and_bias):
    """A sublayer's `(output, bias)` -> output + bias (the bias is returned for the layer to add, as upstream)."""
    output, bias = output_and_bias
    return output if bias is None else output + bias


def _layer(**overrides):
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    return TransformerLayer(tiny_config(**overrides), layer_number=1)


def test_qkv_bias_without_other_biases():
    model = seeded_model(tiny_config(add_bias_linear=False, add_qkv_bias=True))
    biases = sorted(name for name in model.state_dict() if name.endswith(".bias") and "layernorm" not in name)
    assert biases == [f"decoder.layers.{i}.self_attention.linear_qkv.bias" for i in range(2)]
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    with torch.no_grad():
        qkv.bias.copy_(torch.linspace(-1, 1, qkv.bias.numel()))
        x = _hidden()
        output, _ = qkv(x)
    torch.testing.assert_close(output, x @ qkv.weight.t() + qkv.bias)
    plain = seeded_model(tiny_config(add_bias_linear=False))
    assert all(not name.endswith(".bias") or "layernorm" in name for name in plain.state_dict())


def _pair_rotation(x, positions, base, rot_dim):
    """Explicit rotation of each pair (x_2i, x_2i+1) by position * base^(-2i / rot_dim); the rest passes."""
    out = x.clone().double()
    for s, position in enumerate(positions):
        for i in range(rot_dim // 2):
            angle = position * base ** (-2 * i / rot_dim)
            a, b = x[s, ..., 2 * i].double(), x[s, ..., 2 * i + 1].double()
            out[s, ..., 2 * i] = a * math.cos(angle) - b * math.sin(angle)
            out[s, ..., 2 * i + 1] = a * math.sin(angle) + b * math.cos(angle)
    return out


@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
def test_rotary_interleaved_rotates_adjacent_pairs(rotary_percent):
    head_dim, base = 8, 100.0
    x = torch.randn(5, 2, 3, head_dim, generator=torch.Generator().manual_seed(2))
    rope = RotaryEmbedding(head_dim, rotary_percent=rotary_percent, rotary_base=base, rotary_interleaved=True)
    rotated = apply_rotary_pos_emb(x, rope(5), interleaved=True)
    expected = _pair_rotation(x, range(5), base, rope.rot_dim)
    assert (rotated.double() - expected).abs().max().item() < 1e-5


def test_interpolation_factor_divides_positions():
    head_dim, factor = 8, 4.0
    x = torch.randn(7, 1, 2, head_dim, generator=torch.Generator().manual_seed(3))
    for interleaved in (False, True):
        scaled = RotaryEmbedding(head_dim, rotary_interleaved=interleaved, seq_len_interpolation_factor=factor)(7)
        plain = RotaryEmbedding(head_dim, rotary_interleaved=interleaved)
        positions = torch.arange(7, dtype=torch.float32) / factor
        expected = torch.outer(positions, plain.inverse_frequencies(None))
        expected = expected.repeat_interleave(2, -1) if interleaved else torch.cat((expected, expected), -1)
        torch.testing.assert_close(scaled[:, 0, 0, :], expected)
    rotated = apply_rotary_pos_emb(x, scaled, interleaved=True)
    expected = _pair_rotation(x, [p / factor for p in range(7)], 10000.0, head_dim)
    assert (rotated.double() - expected).abs().max().item() < 1e-5


def test_gpt_model_uses_rotary_config():
    config = tiny_config(rotary_interleaved=True, rotary_seq_len_interpolation_factor=2.0)
    model = seeded_model(config, position_embedding_type="rope")
    assert model.rotary_pos_emb.rotary_interleaved and model.rotary_pos_emb.seq_len_interpolation_factor == 2.0
    tokens, labels, positions = fixed_batch()
    interleaved_loss = model(tokens, positions, labels=labels)
    halves_loss = seeded_model(tiny_config(), position_embedding_type="rope")(tokens, positions, labels=labels)
    assert not torch.allclose(interleaved_loss, halves_loss)


def test_post_layernorm_residual_matches_hand_written_layer():
    layer = _layer(apply_residual_connection_post_layernorm=True)
    x = _hidden()
    with torch.no_grad():
        normed = layer.input_layernorm(x)
        y = normed + _summed(layer.self_attention(normed))
        normed_y = layer.pre_mlp_layernorm(y)
        expected = normed_y + _summed(layer.mlp(normed_y))
        torch.testing.assert_close(layer(x)[0], expected)
        pre_norm = _layer()
        pre_norm.load_state_dict(layer.state_dict())
        y = x + _summed(pre_norm.self_attention(pre_norm.input_layernorm(x)))
        torch.testing.assert_close(pre_norm(x)[0], y + _summed(pre_norm.mlp(pre_norm.pre_mlp_layernorm(y))))


def test_fp32_residual_under_bf16():
    overrides = dict(bf16=True, params_dtype=torch.bfloat16, fp32_residual_connection=True)
    layer = _layer(**overrides)
    x = _hidden()
    with torch.no_grad():
        output, _ = layer(x)
        assert output.dtype == torch.float32
        attention = _summed(layer.self_attention(layer.input_layernorm(x.to(torch.bfloat16))))
        y = x + attention.float()
        expected = y + _summed(layer.mlp(layer.pre_mlp_layernorm(y.to(torch.bfloat16)))).float()
        torch.testing.assert_close(output, expected)
    assert tiny_config(**overrides).pipeline_dtype == torch.float32
    model = seeded_model(tiny_config(**overrides))
    seen = []
    for block_layer in model.decoder.layers:
        block_layer.register_forward_hook(lambda module, inputs, out: seen.append((inputs[0].dtype, out[0].dtype)))
    tokens, labels, positions = fixed_batch()
    loss = model(tokens, positions, labels=labels)
    assert seen == [(torch.float32, torch.float32)] * 2 and torch.isfinite(loss).all()
    with pytest.raises(ValueError, match="--fp32-residual-connection"):
        tiny_config(fp32_residual_connection=True)


def test_openai_gelu_is_the_tanh_formula():
    x = torch.linspace(-5, 5, 101, dtype=torch.float64)
    expected = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    torch.testing.assert_close(openai_gelu(x), expected)
    assert (openai_gelu(x) - F.gelu(x)).abs().max() > 1e-5  # not the erf GeLU
    mlp = MLP(tiny_config(activation_func=openai_gelu))
    h = _hidden()
    with torch.no_grad():
        expected = F.linear(openai_gelu(F.linear(h, mlp.linear_fc1.weight, mlp.linear_fc1.bias)),
                            mlp.linear_fc2.weight, mlp.linear_fc2.bias)
        output, bias = mlp(h)  # (output, bias) as upstream: the layer adds fc2's bias
        assert bias is mlp.linear_fc2.bias
        torch.testing.assert_close(output + bias, expected)


def test_cpu_initialization_gives_the_same_weights():
    default = seeded_model(tiny_config())
    on_host = seeded_model(tiny_config(use_cpu_initialization=True))
    assert all(p.device.type == "cpu" for p in on_host.parameters())
    for (name, a), (_, b) in zip(default.named_parameters(), on_host.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("field", ["rotary_interleaved", "rotary_seq_len_interpolation_factor"])
def test_rotary_variants_refused_with_multi_latent_attention(field):
    value = True if field == "rotary_interleaved" else 2.0
    with pytest.raises(ValueError, match="--multi-latent-attention"):
        TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, multi_latent_attention=True,
                          **{field: value})


def test_post_layernorm_residual_under_transformer_engine_applies_the_norms_itself(monkeypatch):
    """With TE's layers (the fake TE bases of the extension tests) the post-layernorm residual needs the norm's
    output, so the layer does not fuse its norms into QKV / fc1 and computes what the local layer computes."""
    from megatron.core.extensions import transformer_engine as te_backend
    from tests.unit_tests.extensions.test_transformer_engine import _FakeTELayerNormLinearBase, _FakeTELinearBase

    te_column, te_row, _ = te_backend.make_te_linear_classes(_FakeTELinearBase, _FakeTELayerNormLinearBase)
    monkeypatch.setattr(te_backend, "te_linear_classes", lambda: (te_column, te_row, _))
    local = _layer(apply_residual_connection_post_layernorm=True)
    te_layer = _layer(apply_residual_connection_post_layernorm=True, transformer_impl="transformer_engine")
    assert not te_layer.norms_fused_into_linears and not te_layer.norms_fused_into_mlp
    assert type(te_layer.self_attention.linear_qkv) is te_column and type(te_layer.mlp.linear_fc1) is te_column
    te_layer.load_state_dict(local.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(te_layer(_hidden()), local(_hidden()), rtol=1e-6, atol=1e-6)

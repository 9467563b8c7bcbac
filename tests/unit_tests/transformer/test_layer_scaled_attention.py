"""--apply-query-key-layer-scaling: with fp16 inputs the scores are formed divided by the layer number and
rescaled in fp32 (same attention, no fp16 overflow where the plain fp16 scores overflow); with fp32 inputs the
flag changes nothing, bit for bit."""

import math

import pytest
import torch

from megatron.core.transformer import layer_scaled_attention as scaled
from tests.unit_tests.models.gpt.gpt_test_utils import fixed_batch, seeded_model, tiny_config


def _reference(query, key, value, mask):
    """fp64 attention: softmax(Q.K^T / sqrt(d)) V with key/value groups repeated over their heads."""
    query, key, value = (t.double() for t in (query, key, value))
    repeat = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    scores = query @ key.transpose(-2, -1) / math.sqrt(query.shape[-1])
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ value


def _inputs(scale, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = scale * torch.randn(2, 4, 6, 16, generator=generator)
    key = scale * torch.randn(2, 2, 6, 16, generator=generator)
    value = torch.randn(2, 2, 6, 16, generator=generator)
    return query.half(), key.half(), value.half()


def test_fp16_layer_scaled_attention_is_attention():
    query, key, value = _inputs(1.0)
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    context = scaled.layer_scaled_attention(query, key, value, None, layer_number=3, dropout_p=0.0)
    assert context.dtype == torch.float16
    # fp16 output: rounding of 2^-11 relative, plus fp16 products and sums over 16 channels.
    torch.testing.assert_close(context.double(), _reference(query, key, value, causal), atol=2e-3, rtol=2e-3)
    padding = torch.zeros(2, 1, 6, 6, dtype=torch.bool)
    padding[..., 4:] = True  # the last two keys masked out
    context = scaled.layer_scaled_attention(query, key, value, padding, layer_number=3, dropout_p=0.0)
    torch.testing.assert_close(context.double(), _reference(query, key, value, padding), atol=2e-3, rtol=2e-3)


def test_scaling_keeps_fp16_scores_finite_where_plain_fp16_overflows():
    query, key, value = _inputs(200.0, seed=1)  # |Q.K^T| / sqrt(16) reaches ~1e5 > fp16's 65504
    plain_scores = torch.baddbmm(torch.empty(8, 6, 6, dtype=torch.float16), query.reshape(8, 6, 16),
                                 key.repeat_interleave(2, dim=1).reshape(8, 6, 16).transpose(1, 2), beta=0.0,
                                 alpha=0.25)  # Q.K^T / sqrt(d) in fp16 without the layer scaling
    assert torch.isinf(plain_scores).any()
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    context = scaled.layer_scaled_attention(query, key, value, None, layer_number=8, dropout_p=0.0)
    assert torch.isfinite(context).all()
    torch.testing.assert_close(context.double(), _reference(query, key, value, causal), atol=2e-3, rtol=2e-3)


def _loss(config_overrides, dtype):
    model = seeded_model(tiny_config(**config_overrides)).to(dtype)
    tokens, labels, position_ids = fixed_batch()
    return model(tokens, position_ids, labels=labels).detach()


def test_fp32_model_is_unchanged_bit_for_bit(monkeypatch):
    calls = []
    monkeypatch.setattr(scaled, "layer_scaled_attention", lambda *args: calls.append(args))
    assert torch.equal(_loss({"apply_query_key_layer_scaling": True}, torch.float32), _loss({}, torch.float32))
    assert calls == []


def test_fp16_model_takes_the_scaled_path_per_layer(monkeypatch):
    layers = []
    real = scaled.layer_scaled_attention
    monkeypatch.setattr(scaled, "layer_scaled_attention",
                        lambda q, k, v, mask, layer_number, p: layers.append(layer_number) or real(q, k, v, mask,
                                                                                                   layer_number, p))
    overrides = {"fp16": True, "params_dtype": torch.float16}
    with_scaling = _loss({**overrides, "apply_query_key_layer_scaling": True}, torch.float16)
    assert layers == [1, 2]
    # The same attention up to fp16 rounding of the scores (the loss is ~ln(64) = 4.2).
    torch.testing.assert_close(with_scaling, _loss(overrides, torch.float16), atol=5e-3, rtol=0)


def test_rejects_layer_number_zero():
    query, key, value = _inputs(1.0)
    with pytest.raises(ValueError, match="layer_number"):
        scaled.layer_scaled_attention(query, key, value, None, layer_number=0, dropout_p=0.0)

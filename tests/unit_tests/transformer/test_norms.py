"""Normalisation layers: zero-centred weights (`--apply-layernorm-1p`) compute the plain layer with weight + 1,
start at zero (also after `reset_parameters` and meta-device materialisation), and carry the TP attributes."""

import pytest
import torch

from megatron.core.transformer.norms import LayerNorm1P, RMSNorm1P, build_norm
from megatron.core.transformer.transformer_config import TransformerConfig


@pytest.mark.parametrize("normalization, plain_class", [("LayerNorm", torch.nn.LayerNorm),
                                                         ("RMSNorm", torch.nn.RMSNorm)])
def test_zero_centred_norm_equals_plain_norm_with_weight_plus_one(normalization, plain_class):
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization=normalization,
                               layernorm_zero_centered_gamma=True)
    norm = build_norm(config, 8)
    assert isinstance(norm, LayerNorm1P if normalization == "LayerNorm" else RMSNorm1P)
    assert torch.equal(norm.weight, torch.zeros(8))  # starts at gamma = 1
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8, generator=generator))
    plain = plain_class(8, eps=config.layernorm_epsilon)
    with torch.no_grad():
        plain.weight.copy_(norm.weight + 1)
        if normalization == "LayerNorm":
            norm.bias.copy_(torch.randn(8, generator=generator))
            plain.bias.copy_(norm.bias)
    x = torch.randn(4, 3, 8, generator=generator)
    assert torch.allclose(norm(x), plain(x), rtol=0, atol=1e-6)
    assert not norm.weight.tensor_model_parallel and not norm.weight.sequence_parallel
    norm.reset_parameters()
    assert torch.equal(norm.weight, torch.zeros(8))


def test_zero_centred_norm_materialises_from_meta_at_zero():
    with torch.device("meta"):
        norm = LayerNorm1P(8)
    norm = norm.to_empty(device="cpu")
    norm.reset_parameters()
    assert torch.equal(norm.weight, torch.zeros(8)) and torch.equal(norm.bias, torch.zeros(8))

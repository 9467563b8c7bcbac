"""Llama 3.1's RoPE frequency scaling (`--use-rope-scaling`) against the rule written out here: slow frequencies
divided by the factor, fast ones kept, the band between blended; and a GPT model built with it computes what a
model with those frequencies set by hand computes."""

import math

import pytest
import torch

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding, llama3_scaled_frequencies
from tests.unit_tests.models.gpt.gpt_test_utils import fixed_batch, seeded_model, tiny_config

# Head of 8 channels, base 1e6: inverse frequencies 1, 1e6^-1/4, 1e-3, 1e6^-3/4, whose wavelengths 2 pi / f
# (6.3, 199, 6283, 198692) fall below 8192 / 4 (kept), below, between 8192 / 4 and 8192 (blended), above (divided).
HEAD_DIM, BASE = 8, 1_000_000


def _llama3_rule(frequency, factor):
    """One frequency, in float64, as the Llama 3.1 release describes it (context 8192, factors 1 and 4)."""
    wavelength = 2 * math.pi / frequency
    if wavelength < 8192 / 4:
        return frequency
    if wavelength > 8192 / 1:
        return frequency / factor
    blend = (8192 / wavelength - 1) / (4 - 1)
    return (1 - blend) * frequency / factor + blend * frequency


def _expected_frequencies(factor):
    return [_llama3_rule(BASE ** (-2 * i / HEAD_DIM), factor) for i in range(HEAD_DIM // 2)]


def test_hand_checked_frequencies():
    # wavelength 2 pi (fast: kept), 4096 (s = (2 - 1) / 3: (2/3) f / 8 + (1/3) f = 5/12 f), 20000 (slow: f / 8)
    fast, medium, slow = 1.0, 2 * math.pi / 4096, 2 * math.pi / 20000
    scaled = llama3_scaled_frequencies(torch.tensor([fast, medium, slow], dtype=torch.float64), 8.0)
    assert scaled.tolist() == pytest.approx([fast, medium * 5 / 12, slow / 8], rel=1e-12)
    # the blend meets both ends: wavelength 8192 gives f / factor, 2048 gives f
    edges = torch.tensor([2 * math.pi / 8192, 2 * math.pi / 2048], dtype=torch.float64)
    assert llama3_scaled_frequencies(edges, 32.0).tolist() == pytest.approx(
        [edges[0].item() / 32, edges[1].item()], rel=1e-12)


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_rotary_embedding_scales_its_frequencies(factor):
    scaled = RotaryEmbedding(HEAD_DIM, rotary_base=BASE, rope_scaling=True, rope_scaling_factor=factor)
    plain = RotaryEmbedding(HEAD_DIM, rotary_base=BASE)
    expected = _expected_frequencies(factor)
    frequencies = scaled.inverse_frequencies("cpu")
    assert frequencies.dtype == torch.float32
    assert frequencies.tolist() == pytest.approx(expected, rel=1e-6)
    unscaled = plain.inverse_frequencies("cpu")
    assert frequencies[:2].tolist() == unscaled[:2].tolist()  # the fast ones are untouched
    assert frequencies[3].item() == pytest.approx(unscaled[3].item() / factor, rel=1e-6)
    angles = scaled(5)
    torch.testing.assert_close(angles[:, 0, 0, :HEAD_DIM // 2],
                               torch.outer(torch.arange(5.0), torch.tensor(expected, dtype=torch.float32)))
    with pytest.raises(ValueError, match="--rope-scaling-factor must be positive, got 0"):
        RotaryEmbedding(HEAD_DIM, rope_scaling=True, rope_scaling_factor=0)


def test_gpt_model_with_rope_scaling_equals_hand_set_frequencies():
    # Weights large enough (std 0.3) that attention, and so the logits, feel the slower rotation.
    config = tiny_config(init_method_std=0.3)
    assert config.kv_channels == HEAD_DIM
    tokens, _, positions = fixed_batch(seq=16)
    kwargs = dict(position_embedding_type="rope", rotary_base=BASE)
    with torch.no_grad():
        scaled = seeded_model(config, rope_scaling=True, rope_scaling_factor=8.0, **kwargs)(tokens, positions)
        plain_model = seeded_model(config, **kwargs)
        plain = plain_model(tokens, positions)
        by_hand = torch.tensor(_expected_frequencies(8.0), dtype=torch.float32)
        plain_model.rotary_pos_emb.inverse_frequencies = lambda device: by_hand.to(device)
        hand_set = plain_model(tokens, positions)
    # Measured: logits up to 6.5, 0.11 apart from the plain model's, 5e-6 from the hand-set one's (the float32
    # rounding of the hand-computed frequencies differs in the last bit).
    torch.testing.assert_close(scaled, hand_set, rtol=1e-5, atol=1e-5)
    assert (scaled - plain).abs().max().item() > 0.05
    with pytest.raises(ValueError, match="--use-rope-scaling .* needs --position-embedding-type rope"):
        seeded_model(config, rope_scaling=True)

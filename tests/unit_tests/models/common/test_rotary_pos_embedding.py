"""RoPE against a complex-number formulation, plus the norm- and relative-position properties it must have."""

import pytest
import torch

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding, apply_rotary_pos_emb


def _complex_rope(x, base, rot_dim):
    """x: [s, b, heads, d]; channel i pairs with i + rot_dim/2 as the complex number x_i + j x_{i+rot_dim/2}."""
    seq, half = x.shape[0], rot_dim // 2
    inverse_frequency = base ** (-torch.arange(half, dtype=torch.float64) * 2 / rot_dim)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inverse_frequency[None, :]
    rotation = torch.polar(torch.ones_like(angles), angles)[:, None, None, :]
    z = torch.complex(x[..., :half].double(), x[..., half:rot_dim].double()) * rotation
    return torch.cat((z.real, z.imag, x[..., rot_dim:].double()), dim=-1)


@pytest.mark.parametrize("rotary_percent, base", [(1.0, 10000), (0.5, 500)])
def test_rotation_matches_complex_reference(rotary_percent, base):
    head_dim, seq = 16, 12
    x = torch.randn(seq, 2, 3, head_dim, generator=torch.Generator().manual_seed(3))
    rope = RotaryEmbedding(head_dim, rotary_percent=rotary_percent, rotary_base=base)
    angles = rope(seq)
    assert angles.shape == (seq, 1, 1, int(head_dim * rotary_percent))
    rotated = apply_rotary_pos_emb(x, angles)
    expected = _complex_rope(x, base, rope.rot_dim)
    assert (rotated.double() - expected).abs().max().item() < 1e-5


def test_scores_depend_only_on_relative_position():
    head_dim = 8
    rope = RotaryEmbedding(head_dim)
    angles = rope(20)
    q = torch.randn(1, 1, 1, head_dim, generator=torch.Generator().manual_seed(1)).expand(20, 1, 1, head_dim)
    k = torch.randn(1, 1, 1, head_dim, generator=torch.Generator().manual_seed(2)).expand(20, 1, 1, head_dim)
    rq, rk = apply_rotary_pos_emb(q, angles), apply_rotary_pos_emb(k, angles)
    score = lambda i, j: (rq[i] * rk[j]).sum().item()
    assert score(5, 2) == pytest.approx(score(15, 12), abs=1e-5)
    assert rq.norm(dim=-1).sub(q.norm(dim=-1)).abs().max().item() < 1e-5


def test_invalid_rotary_dimension():
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(6, rotary_percent=0.5)
    with pytest.raises(ValueError, match="--rotary-percent"):
        RotaryEmbedding(8, rotary_percent=0.0)


@pytest.mark.parametrize("base", [0, -10000])
def test_non_positive_rotary_base_is_refused(base):
    # base ** 0 = 1 but 0 ** x = 0 (negative bases give NaN): the angles would not be finite.
    with pytest.raises(ValueError, match=rf"^--rotary-base must be positive, got {base}$"):
        RotaryEmbedding(8, rotary_base=base)
    assert torch.isfinite(RotaryEmbedding(8, rotary_base=10000)(4)).all()


# Upstream's signatures: RotaryEmbedding(kv_channels, rotary_percent, rotary_interleaved,
# seq_len_interpolation_factor, rotary_base, ...), forward(max_seq_len, offset, packed_seq),
# YarnRotaryEmbedding(kv_channels, rotary_percent, rotary_interleaved, seq_len_interpolation_factor, rotary_base,
# scaling_factor, ...) and apply_rotary_pos_emb(t, freqs, config, cu_seqlens, mscale, cp_group): positional calls
# written for upstream must mean the same here.


def _reference_angles(seq, rot_dim, base, interleaved=False, interpolation=1.0, offset=0):
    """[s, 1, 1, rot_dim] float64: position / interpolation times base^(-2i / rot_dim), each pair's angle twice."""
    inverse_frequency = base ** (-torch.arange(rot_dim // 2, dtype=torch.float64) * 2 / rot_dim)
    positions = torch.arange(offset, offset + seq, dtype=torch.float64) / interpolation
    angles = positions[:, None] * inverse_frequency[None, :]
    doubled = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    return doubled[:, None, None, :]


def test_positional_arguments_follow_upstream_order():
    rope = RotaryEmbedding(16, 0.5, True, 2.0, 500000)  # 8 of 16 channels, interleaved, positions / 2
    expected = _reference_angles(6, 8, 500000.0, interleaved=True, interpolation=2.0)
    torch.testing.assert_close(rope(6).double(), expected, rtol=1e-6, atol=1e-6)
    offset_expected = _reference_angles(3, 8, 500000.0, interleaved=True, interpolation=2.0, offset=4)
    torch.testing.assert_close(rope(3, 4).double(), offset_expected, rtol=1e-6, atol=1e-6)  # (max_seq_len, offset)
    torch.testing.assert_close(rope.inv_freq.double(), expected[1, 0, 0, 0::2] * 2.0, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(rope(6, 0, True), rope(6), rtol=0, atol=0)  # packed_seq: every position


def test_yarn_positional_arguments_follow_upstream_order():
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    positional = YarnRotaryEmbedding(8, 1.0, False, None, 500000.0, 4.0, 64)
    keywords = YarnRotaryEmbedding(8, rotary_base=500000.0, scaling_factor=4.0, original_max_position_embeddings=64)
    assert (positional.rotary_base, positional.scaling_factor) == (500000.0, 4.0)
    torch.testing.assert_close(positional(5), keywords(5), rtol=0, atol=0)
    with pytest.raises(ValueError, match="--rotary-seq-len-interpolation-factor does not combine with YaRN"):
        YarnRotaryEmbedding(8, 1.0, False, 2.0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_takes_upstreams_config_and_mscale(interleaved):
    from tests.unit_tests.models.gpt.gpt_test_utils import tiny_config

    config = tiny_config(rotary_interleaved=interleaved)
    x = torch.randn(5, 2, 3, 8, generator=torch.Generator().manual_seed(3))
    angles = RotaryEmbedding(8, rotary_interleaved=interleaved)(5)
    rotated = apply_rotary_pos_emb(x, angles, config, None, 1.5)  # upstream: (t, freqs, config, cu_seqlens, mscale)
    if interleaved:  # channel pairs (2i, 2i + 1): the rotate-half reference on the regrouped channels
        regrouped = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        expected = _complex_rope(regrouped, 10000, 8)
        expected = torch.stack((expected[..., :4], expected[..., 4:]), dim=-1).flatten(-2)
    else:
        expected = _complex_rope(x, 10000, 8)
    torch.testing.assert_close(rotated.double(), 1.5 * expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("batch_dim", [False, True])
def test_packed_sequences_restart_their_positions(batch_dim):
    """Upstream's THD call `apply_rotary_pos_emb(t, freqs, config, cu_seqlens)`: `t` `[t, heads, d]` holds sequences
    of 3, 5 and 2 rows back to back, then 2 rows of padding; each sequence is rotated as if it ran alone (the
    complex reference from position 0), the padding rows as position 0 (left as they are)."""
    from tests.unit_tests.models.gpt.gpt_test_utils import tiny_config

    lengths = (3, 5, 2)
    x = torch.randn(sum(lengths) + 2, 3, 8, generator=torch.Generator().manual_seed(5))
    cu_seqlens = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    angles = RotaryEmbedding(8)(max(lengths))  # the longest sequence's positions, as get_rotary_seq_len asks
    packed = x.unsqueeze(1) if batch_dim else x
    rotated = apply_rotary_pos_emb(packed, angles, tiny_config(), cu_seqlens).double()
    rotated = rotated[:, 0] if batch_dim else rotated
    start = 0
    for length in lengths:
        expected = _complex_rope(x[start:start + length, None], 10000, 8)[:, 0]
        torch.testing.assert_close(rotated[start:start + length], expected, rtol=0, atol=1e-5)
        start += length
    torch.testing.assert_close(rotated[start:], x[start:].double(), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"a packed sequence is longer than the 4 positions of freqs"):
        apply_rotary_pos_emb(x, angles[:4], tiny_config(), cu_seqlens)

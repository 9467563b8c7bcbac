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

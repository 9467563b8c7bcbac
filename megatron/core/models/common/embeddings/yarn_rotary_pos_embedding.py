"""YaRN rotary embedding (rotary scaling for long contexts) and the RoPE layout multi-latent attention uses.

YaRN stretches a RoPE trained on `original_max_position_embeddings` positions by `scaling_factor` s:
- frequencies that turn more than `beta_fast` times over the original context (high frequencies, local order)
  keep their value; those that turn fewer than `beta_slow` times are divided by s (interpolated); a linear ramp
  over the channel pairs in between blends the two;
- attention logits are sharpened to make up for the flatter distribution: with
  `ms(s, a) = 1 if s <= 1 else 0.1 * a * ln(s) + 1`, cos and sin are multiplied by `ms(s, mscale) /
  ms(s, mscale_all_dim)` and multi-latent attention multiplies its softmax scale by `ms(s, mscale_all_dim)^2`.
With s = 1 both corrections are 1 and the frequencies are RoPE's: YaRN is then plain RoPE.

Multi-latent attention rotates channel pairs (2i, 2i + 1) (the layout of DeepSeek's checkpoints): the even
channels are gathered before the odd ones, then the rotate-half rotation applies (`apply_rotary_pos_emb_regrouped`).
"""

import math

import torch


def yarn_get_mscale(scaling_factor: float, mscale: float) -> float:
    """ms(s, a): 1 for s <= 1, else 0.1 * a * ln(s) + 1."""
    if scaling_factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scaling_factor) + 1.0


def _correction_dim(num_rotations: float, rot_dim: int, base: float, original_max_positions: int) -> float:
    """The (fractional) channel-pair index whose frequency turns `num_rotations` times over the original context."""
    return rot_dim * math.log(original_max_positions / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_correction_range(beta_fast: float, beta_slow: float, rot_dim: int, base: float,
                          original_max_positions: int) -> tuple:
    """(low, high): channel pairs below `low` keep RoPE's frequency, pairs above `high` are interpolated."""
    low = math.floor(_correction_dim(beta_fast, rot_dim, base, original_max_positions))
    high = math.ceil(_correction_dim(beta_slow, rot_dim, base, original_max_positions))
    return max(low, 0), min(high, rot_dim - 1)


def yarn_linear_ramp(low: float, high: float, num_pairs: int) -> torch.Tensor:
    """0 up to pair `low`, 1 from pair `high`, linear in between (fp32, `[num_pairs]`)."""
    if low == high:
        high += 0.001  # a one-pair ramp still needs a non-zero width
    ramp = (torch.arange(num_pairs, dtype=torch.float32) - low) / (high - low)
    return torch.clamp(ramp, 0.0, 1.0)


class YarnRotaryEmbedding(torch.nn.Module):
    """The rotation angles `[s, 1, 1, rot_dim]` of YaRN-scaled RoPE, and the factor cos and sin are scaled by.

    Args:
        rot_dim: rotated channels per head (even).
        rotary_base: base of the frequencies (`--rotary-base`).
        scaling_factor: s (`--rotary-scaling-factor`).
        original_max_position_embeddings: the context the unscaled RoPE was trained for.
        beta_fast, beta_slow: rotation counts bounding the blend between kept and interpolated frequencies.
        mscale, mscale_all_dim: `--mscale`, `--mscale-all-dim`.
    """

    def __init__(self, rot_dim: int, rotary_base: float = 10000.0, scaling_factor: float = 1.0,
                 original_max_position_embeddings: int = 4096, beta_fast: float = 32.0, beta_slow: float = 1.0,
                 mscale: float = 1.0, mscale_all_dim: float = 0.0):
        super().__init__()
        if rot_dim < 2 or rot_dim % 2 != 0:
            raise ValueError(f"the rotated width (--qk-pos-emb-head-dim) must be an even number >= 2, got {rot_dim}")
        if scaling_factor <= 0:
            raise ValueError(f"--rotary-scaling-factor must be positive, got {scaling_factor}")
        self.rot_dim = rot_dim
        self.rotary_base = float(rotary_base)
        self.scaling_factor = float(scaling_factor)
        self.original_max_position_embeddings = int(original_max_position_embeddings)
        self.beta_fast, self.beta_slow = float(beta_fast), float(beta_slow)
        self.mscale, self.mscale_all_dim = float(mscale), float(mscale_all_dim)

    @property
    def cos_sin_scale(self) -> float:
        """ms(s, mscale) / ms(s, mscale_all_dim): the factor on cos and sin."""
        return (yarn_get_mscale(self.scaling_factor, self.mscale)
                / yarn_get_mscale(self.scaling_factor, self.mscale_all_dim))

    def inverse_frequencies(self, device=None) -> torch.Tensor:
        exponents = torch.arange(0, self.rot_dim, 2, dtype=torch.float32) / self.rot_dim
        extrapolated = 1.0 / (self.rotary_base**exponents)  # RoPE's own frequencies
        interpolated = extrapolated / self.scaling_factor
        low, high = yarn_correction_range(self.beta_fast, self.beta_slow, self.rot_dim, self.rotary_base,
                                          self.original_max_position_embeddings)
        keep = 1.0 - yarn_linear_ramp(low, high, self.rot_dim // 2)  # 1: keep RoPE's frequency, 0: interpolate
        return (interpolated * (1.0 - keep) + extrapolated * keep).to(device)

    def forward(self, seq_len: int, device=None) -> torch.Tensor:
        positions = torch.arange(seq_len, dtype=torch.float32, device=device)
        angles = torch.outer(positions, self.inverse_frequencies(device))  # [s, rot_dim / 2]
        return torch.cat((angles, angles), dim=-1)[:, None, None, :]


def apply_rotary_pos_emb_regrouped(t: torch.Tensor, angles: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Rotates the channel pairs (2i, 2i + 1) of `t` (`[s, b, heads, rot_dim]`, all channels rotated) by
    `angles` (`[s, 1, 1, rot_dim]`), with cos and sin multiplied by `scale`. The result holds the even channels'
    outputs first, then the odd ones' (computed in fp32, returned in `t`'s dtype)."""
    if t.shape[-1] != angles.shape[-1]:
        raise ValueError(f"rotary angles cover {angles.shape[-1]} channels, the tensor has {t.shape[-1]}")
    t_fp32 = t.float()
    regrouped = torch.cat((t_fp32[..., 0::2], t_fp32[..., 1::2]), dim=-1)
    first, second = torch.chunk(regrouped, 2, dim=-1)
    rotated_half = torch.cat((-second, first), dim=-1)
    cos, sin = angles.cos() * scale, angles.sin() * scale
    return (regrouped * cos + rotated_half * sin).to(t.dtype)

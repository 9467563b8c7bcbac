"""YaRN rotary embedding (rotary scaling for long contexts) and the RoPE layout multi-latent attention uses.

YaRN stretches a RoPE trained on `original_max_position_embeddings` positions by `scaling_factor` s:
- frequencies that turn more than `beta_fast` times over the original context (high frequencies, local order)
  keep their value; those that turn fewer than `beta_slow` times are divided by s (interpolated); a linear ramp
  over the channel pairs in between blends the two;
- attention logits are sharpened to make up for the flatter distribution: with
  `ms(s, a) = 1 if s <= 1 else 0.1 * a * ln(s) + 1`, cos and sin are multiplied by `ms(s, mscale) /
  ms(s, mscale_all_dim)` and multi-latent attention multiplies its softmax scale by `ms(s, mscale_all_dim)^2`.
With s = 1 both corrections are 1 and the frequencies are RoPE's: YaRN is then plain RoPE. The bounds of the
blend are rounded outwards to whole channel pairs unless `correction_range_round_to_int` is False (gpt-oss).

Standard attention uses YaRN with `--position-embedding-type yarn` (the `--yarn-*` flags; the angles come from
`YarnRotaryEmbedding`, a `RotaryEmbedding` whose frequencies are scaled), multi-latent attention with
`--rope-type yarn`; both compute the frequencies and the cos / sin factor here.

Multi-latent attention rotates channel pairs (2i, 2i + 1) (the layout of DeepSeek's checkpoints): the even
channels are gathered before the odd ones, then the rotate-half rotation applies (`apply_rotary_pos_emb_regrouped`).
"""

import math

import torch

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding


def yarn_get_mscale(scaling_factor: float, mscale: float) -> float:
    """ms(s, a): 1 for s <= 1, else 0.1 * a * ln(s) + 1."""
    if scaling_factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scaling_factor) + 1.0


def yarn_cos_sin_scale(scaling_factor: float, mscale: float, mscale_all_dim: float) -> float:
    """ms(s, mscale) / ms(s, mscale_all_dim): the factor on cos and sin (HF's `attention_factor`)."""
    return yarn_get_mscale(scaling_factor, mscale) / yarn_get_mscale(scaling_factor, mscale_all_dim)


def _correction_dim(num_rotations: float, rot_dim: int, base: float, original_max_positions: int) -> float:
    """The (fractional) channel-pair index whose frequency turns `num_rotations` times over the original context."""
    return rot_dim * math.log(original_max_positions / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_correction_range(beta_fast: float, beta_slow: float, rot_dim: int, base: float,
                          original_max_positions: int, round_to_int: bool = True) -> tuple:
    """(low, high): channel pairs below `low` keep RoPE's frequency, pairs above `high` are interpolated;
    `round_to_int` rounds the bounds outwards to whole pairs (HF's `truncate`)."""
    low = _correction_dim(beta_fast, rot_dim, base, original_max_positions)
    high = _correction_dim(beta_slow, rot_dim, base, original_max_positions)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rot_dim - 1)


def yarn_linear_ramp(low: float, high: float, num_pairs: int) -> torch.Tensor:
    """0 up to pair `low`, 1 from pair `high`, linear in between (fp32, `[num_pairs]`)."""
    if low == high:
        high += 0.001  # a one-pair ramp still needs a non-zero width
    ramp = (torch.arange(num_pairs, dtype=torch.float32) - low) / (high - low)
    return torch.clamp(ramp, 0.0, 1.0)


def yarn_scaled_frequencies(inverse_frequencies: torch.Tensor, scaling_factor: float, base: float,
                            original_max_positions: int, beta_fast: float, beta_slow: float,
                            round_to_int: bool = True) -> torch.Tensor:
    """YaRN's frequencies from RoPE's (`[rot_dim / 2]`, base `base`): the fast ones kept, the slow ones divided by
    `scaling_factor`, a linear ramp over the channel pairs between `yarn_correction_range`'s bounds."""
    num_pairs = inverse_frequencies.numel()
    low, high = yarn_correction_range(beta_fast, beta_slow, 2 * num_pairs, base, original_max_positions,
                                      round_to_int)
    interpolate = yarn_linear_ramp(low, high, num_pairs).to(inverse_frequencies.device)  # 1: divided by s
    keep = 1.0 - interpolate
    return inverse_frequencies / scaling_factor * (1.0 - keep) + inverse_frequencies * keep


class YarnRotaryEmbedding(RotaryEmbedding):
    """The rotation angles `[s, 1, 1, rot_dim]` of YaRN-scaled RoPE (`RotaryEmbedding`'s layout, offset and
    rotated fraction), and the factor cos and sin are scaled by (`cos_sin_scale`). As upstream, a call returns
    both, `(angles, cos_sin_scale)`; `angles(...)` returns the angles alone.

    Args (upstream's order, so positional calls written for upstream mean the same):
        kv_channels: width of a rotated head (multi-latent attention: its rope channels).
        rotary_percent: fraction of the channels rotated.
        rotary_interleaved: angles for interleaved channel pairs (see `RotaryEmbedding`).
        seq_len_interpolation_factor: must be None: YaRN scales the frequencies itself (upstream accepts and
            ignores it).
        rotary_base: base of the frequencies (`--rotary-base`).
        scaling_factor: s (`--yarn-rotary-scaling-factor`; multi-latent attention: `--rotary-scaling-factor`).
        original_max_position_embeddings: the context the unscaled RoPE was trained for.
        beta_fast, beta_slow: rotation counts bounding the blend between kept and interpolated frequencies.
        mscale, mscale_all_dim: set the factor on cos and sin (see the module docstring).
        correction_range_round_to_int: round the blend's channel range outwards to whole pairs.
        use_cpu_initialization, cp_group: as `RotaryEmbedding`'s (under context parallelism a call returns this
            rank's share of the angles).
    """

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_interleaved: bool = False,
                 seq_len_interpolation_factor=None, rotary_base: float = 10000.0, scaling_factor: float = 1.0,
                 original_max_position_embeddings: int = 4096, beta_fast: float = 32.0, beta_slow: float = 1.0,
                 mscale: float = 1.0, mscale_all_dim: float = 0.0, correction_range_round_to_int: bool = True,
                 use_cpu_initialization: bool = False, cp_group=None):
        if seq_len_interpolation_factor is not None:
            raise ValueError("--rotary-seq-len-interpolation-factor does not combine with YaRN, which scales the "
                             "frequencies itself (--yarn-rotary-scaling-factor): drop it")
        if not scaling_factor > 0:
            raise ValueError(f"the YaRN scaling factor must be positive, got {scaling_factor}")
        super().__init__(kv_channels, rotary_percent=rotary_percent, rotary_base=rotary_base,
                         rotary_interleaved=rotary_interleaved, cp_group=cp_group)
        self.scaling_factor = float(scaling_factor)
        self.original_max_position_embeddings = int(original_max_position_embeddings)
        self.beta_fast, self.beta_slow = float(beta_fast), float(beta_slow)
        self.mscale, self.mscale_all_dim = float(mscale), float(mscale_all_dim)
        self.correction_range_round_to_int = bool(correction_range_round_to_int)

    @property
    def cos_sin_scale(self) -> float:
        """ms(s, mscale) / ms(s, mscale_all_dim): the factor on cos and sin."""
        return yarn_cos_sin_scale(self.scaling_factor, self.mscale, self.mscale_all_dim)

    def inverse_frequencies(self, device=None) -> torch.Tensor:
        return yarn_scaled_frequencies(super().inverse_frequencies(device), self.scaling_factor, self.rotary_base,
                                       self.original_max_position_embeddings, self.beta_fast, self.beta_slow,
                                       self.correction_range_round_to_int)

    def angles(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, device=None) -> torch.Tensor:
        """The angles `[s, 1, 1, rot_dim]` of positions `offset .. offset + max_seq_len - 1` (this rank's share
        under context parallelism, see `RotaryEmbedding.forward`), without the factor on cos and sin."""
        return super().forward(max_seq_len, offset=offset, packed_seq=packed_seq, device=device)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, device=None):
        """(angles, factor on cos and sin), as upstream's `emb, mscale = yarn(max_seq_len)`: the angles of
        positions `offset .. offset + max_seq_len - 1` (`angles`) and `cos_sin_scale`."""
        return self.angles(max_seq_len, offset=offset, packed_seq=packed_seq, device=device), self.cos_sin_scale


def rotary_angles(rotary_embedding: RotaryEmbedding, max_seq_len: int, offset: int = 0, device=None) -> torch.Tensor:
    """All the angles of `rotary_embedding`, a `RotaryEmbedding` or a `YarnRotaryEmbedding`, whatever the context
    parallelism (`full_angles`; the factor YaRN scales cos and sin by comes from the config)."""
    return rotary_embedding.full_angles(max_seq_len, offset=offset, device=device)


def local_rotary_angles(rotary_embedding: RotaryEmbedding, max_seq_len: int, device=None) -> torch.Tensor:
    """This context-parallel rank's share of the angles of a `max_seq_len`-long sequence (the module's call,
    without YaRN's factor on cos and sin)."""
    if isinstance(rotary_embedding, YarnRotaryEmbedding):
        return rotary_embedding.angles(max_seq_len, device=device)
    return rotary_embedding(max_seq_len, device=device)


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

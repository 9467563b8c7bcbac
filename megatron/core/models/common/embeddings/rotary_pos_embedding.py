"""Rotary position embedding (RoPE): rotates pairs of query/key channels by a position-dependent angle.

Channel i of the rotated part is paired with channel i + rot_dim/2 (the "rotate half" layout), and positions
are 0..s-1 of the full sequence the attention sees. Angles are computed in fp32 whatever the activation dtype.
"""

import torch


class RotaryEmbedding(torch.nn.Module):
    """Produces the rotation angles `[s, 1, 1, rot_dim]` for a sequence length.

    Args:
        kv_channels: width of one attention head.
        rotary_percent: fraction of each head's channels that is rotated (the rest passes through).
        rotary_base: the base of the geometric progression of frequencies (`--rotary-base`).
    """

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_base: float = 10000.0):
        super().__init__()
        if not 0.0 < rotary_percent <= 1.0:
            raise ValueError(f"--rotary-percent must be in (0, 1], got {rotary_percent}")
        rot_dim = int(kv_channels * rotary_percent)
        if rot_dim < 2 or rot_dim % 2 != 0:
            raise ValueError(
                f"rotary dimension kv_channels * rotary_percent = {rot_dim} must be an even number >= 2"
            )
        self.rot_dim = rot_dim
        self.rotary_base = float(rotary_base)

    def inverse_frequencies(self, device) -> torch.Tensor:
        exponents = torch.arange(0, self.rot_dim, 2, dtype=torch.float32, device=device) / self.rot_dim
        return 1.0 / (self.rotary_base**exponents)

    def forward(self, seq_len: int, device=None) -> torch.Tensor:
        positions = torch.arange(seq_len, dtype=torch.float32, device=device)
        angles = torch.outer(positions, self.inverse_frequencies(device))  # [s, rot_dim / 2]
        angles = torch.cat((angles, angles), dim=-1)  # both halves of a rotated pair share an angle
        return angles[:, None, None, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = torch.chunk(x, 2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotates the first `angles.shape[-1]` channels of `t` (`[s, b, heads, head_dim]`)."""
    rot_dim = angles.shape[-1]
    rotated, passthrough = t[..., :rot_dim], t[..., rot_dim:]
    rotated_fp32 = rotated.float()
    rotated_fp32 = rotated_fp32 * angles.cos() + _rotate_half(rotated_fp32) * angles.sin()
    return torch.cat((rotated_fp32.to(t.dtype), passthrough), dim=-1)

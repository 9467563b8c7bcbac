"""Rotary position embedding (RoPE): rotates pairs of query/key channels by a position-dependent angle.

Channel i of the rotated part is paired with channel i + rot_dim/2 (the "rotate half" layout), or with
`rotary_interleaved` channel 2i with channel 2i + 1 (`--rotary-interleaved`). Positions are 0..s-1 of the full
sequence the attention sees (offset..offset+s-1 for a decoding step past `offset` cached positions), divided by
`seq_len_interpolation_factor` when given (`--rotary-seq-len-interpolation-factor`). Angles are computed in fp32
whatever the activation dtype.

Under context parallelism (a `cp_group` of more than one rank), as upstream, a call returns this rank's share of
the angles of the whole sequence: its two load-balanced chunks (`context_parallel.local_rows`), matching the
tokens `get_batch_on_this_cp_rank` gives it. `get_rotary_seq_len` gives the whole sequence's length to ask for.

With `rope_scaling` (`--use-rope-scaling`) the frequencies are those of Llama 3.1 (`llama3_scaled_frequencies`):
slow ones divided by `rope_scaling_factor`, fast ones kept, the band between blended. YaRN's scaling is
`yarn_rotary_pos_embedding.YarnRotaryEmbedding`, a subclass.
"""

import copy
import math

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.packed_sequences import packed_rotary_angles, rotary_positions_from_cu_seqlens
from megatron.core.transformer.context_parallel.sequence_split import local_rows

# Llama 3.1's frequency scaling, fixed as upstream Megatron fixes them (only the factor is a flag).
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_MAX_POSITION_EMBEDDINGS = 8192


def llama3_scaled_frequencies(inverse_frequencies: torch.Tensor, factor: float,
                              low_freq_factor: float = LLAMA3_LOW_FREQ_FACTOR,
                              high_freq_factor: float = LLAMA3_HIGH_FREQ_FACTOR,
                              original_context: int = LLAMA3_ORIGINAL_MAX_POSITION_EMBEDDINGS) -> torch.Tensor:
    """Llama 3.1's RoPE frequencies: a frequency whose wavelength 2 pi / f is longer than
    `original_context / low_freq_factor` is divided by `factor`, one shorter than
    `original_context / high_freq_factor` is kept, and one in between is blended,
    (1 - s) f / factor + s f with s = (original_context / wavelength - low_freq_factor) /
    (high_freq_factor - low_freq_factor), which meets both ends continuously."""
    wavelength = 2 * math.pi / inverse_frequencies
    blend = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * inverse_frequencies / factor + blend * inverse_frequencies
    scaled = torch.where(wavelength > original_context / low_freq_factor, inverse_frequencies / factor, blended)
    return torch.where(wavelength < original_context / high_freq_factor, inverse_frequencies, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Produces the rotation angles `[s, 1, 1, rot_dim]` for a sequence length.

    Args (upstream's order, so positional calls written for upstream mean the same):
        kv_channels: width of one attention head.
        rotary_percent: fraction of each head's channels that is rotated (the rest passes through).
        rotary_interleaved: angles laid out for interleaved pairs `[a_0, a_0, a_1, a_1, ...]` (apply them with
            `apply_rotary_pos_emb(..., interleaved=True)`) instead of halves `[a_0, a_1, ..., a_0, a_1, ...]`.
        seq_len_interpolation_factor: positions are divided by it (None: 1).
        rotary_base: the base of the geometric progression of frequencies (`--rotary-base`).
        rope_scaling: Llama 3.1's frequency scaling (`--use-rope-scaling`), by `rope_scaling_factor`
            (`--rope-scaling-factor`).
        use_cpu_initialization: accepted for upstream's signature; the frequencies are computed on the device
            `forward` is asked for, so there is nothing to place.
        cp_group: the context-parallel group whose rank's share of the angles `forward` returns (None:
            parallel_state's context-parallel group, when initialised; no group: the whole sequence).
    """

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_interleaved: bool = False,
                 seq_len_interpolation_factor=None, rotary_base: float = 10000.0, rope_scaling: bool = False,
                 rope_scaling_factor: float = 8.0, use_cpu_initialization: bool = False, cp_group=None):
        super().__init__()
        if cp_group is None:
            cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
        self.cp_group = cp_group
        if rope_scaling and not rope_scaling_factor > 0:
            raise ValueError(f"--rope-scaling-factor must be positive, got {rope_scaling_factor}")
        self.rope_scaling = rope_scaling
        self.rope_scaling_factor = float(rope_scaling_factor)
        if seq_len_interpolation_factor is not None and seq_len_interpolation_factor <= 0:
            raise ValueError(
                f"--rotary-seq-len-interpolation-factor must be positive, got {seq_len_interpolation_factor}"
            )
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        if not 0.0 < rotary_percent <= 1.0:
            raise ValueError(f"--rotary-percent must be in (0, 1], got {rotary_percent}")
        rot_dim = int(kv_channels * rotary_percent)
        if rot_dim < 2 or rot_dim % 2 != 0:
            raise ValueError(
                f"rotary dimension kv_channels ({kv_channels}) x rotary_percent ({rotary_percent}) = {rot_dim} must "
                "be an even number >= 2 (RoPE rotates channel pairs): change --rotary-percent or --kv-channels"
            )
        self.rot_dim = rot_dim
        if not rotary_base > 0:  # base ** exponent would be 0 or undefined: infinite or NaN angles
            raise ValueError(f"--rotary-base must be positive, got {rotary_base}")
        self.rotary_base = float(rotary_base)

    def inverse_frequencies(self, device) -> torch.Tensor:
        exponents = torch.arange(0, self.rot_dim, 2, dtype=torch.float32, device=device) / self.rot_dim
        frequencies = 1.0 / (self.rotary_base**exponents)
        if self.rope_scaling:
            frequencies = llama3_scaled_frequencies(frequencies, self.rope_scaling_factor)
        return frequencies

    @property
    def inv_freq(self) -> torch.Tensor:
        """The frequencies `[rot_dim / 2]` (fp32, CPU), under upstream's attribute name."""
        return self.inverse_frequencies(None)

    def full_angles(self, max_seq_len: int, offset: int = 0, device=None) -> torch.Tensor:
        """The angles `[max_seq_len, 1, 1, rot_dim]` of positions `offset .. offset + max_seq_len - 1`, all of
        them whatever the context parallelism (`forward` cuts them to this rank's share)."""
        positions = torch.arange(offset, offset + max_seq_len, dtype=torch.float32, device=device)
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        angles = torch.outer(positions, self.inverse_frequencies(device))  # [s, rot_dim / 2]
        # Both channels of a rotated pair share an angle.
        if self.rotary_interleaved:
            angles = torch.repeat_interleave(angles, 2, dim=-1)
        else:
            angles = torch.cat((angles, angles), dim=-1)
        return angles[:, None, None, :]

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, device=None) -> torch.Tensor:
        """The angles of positions `offset .. offset + max_seq_len - 1` (a decoding step starts past the cached
        positions), on `device`; with a `cp_group` of N > 1 ranks, this rank's two chunks of them
        (`[max_seq_len / N, 1, 1, rot_dim]`; `max_seq_len` is the whole sequence's length, see
        `get_rotary_seq_len`). Upstream's positional order; with `packed_seq` (THD, as upstream) all the angles,
        whatever the context parallelism: `apply_rotary_pos_emb(cu_seqlens=...)` picks each row's."""
        angles = self.full_angles(max_seq_len, offset=offset, device=device)
        cp_size = 1 if self.cp_group is None else dist.get_world_size(self.cp_group)
        if cp_size == 1 or packed_seq:
            return angles
        if max_seq_len % (2 * cp_size) != 0:
            raise ValueError(
                f"RotaryEmbedding: max_seq_len {max_seq_len} must be the whole sequence's length, divisible by 2 x "
                f"the context-parallel size ({2 * cp_size}); pass the local length x the context-parallel size "
                "(get_rotary_seq_len)"
            )
        return local_rows(angles, 0, cp_size, dist.get_rank(self.cp_group))

    def get_rotary_seq_len(self, inference_context, transformer, transformer_input, transformer_config,
                           packed_seq_params=None, *, inference_params=None) -> int:
        """The whole sequence's length to pass to `forward` (upstream's method): the decoding context's
        `max_sequence_length`, else the length of the block's received `input_tensor` (a later pipeline stage)
        or of `transformer_input` (`[s, b, h]`), times the tensor-parallel size under sequence parallelism;
        either way times the context-parallel size. With `packed_seq_params` (upstream's rule): the longest
        packed sequence, `max(max_seqlen_q, max_seqlen_kv)`."""
        if packed_seq_params is not None:
            bounds = (packed_seq_params.max_seqlen_q, packed_seq_params.max_seqlen_kv)
            if None in bounds:
                raise ValueError("RotaryEmbedding.get_rotary_seq_len(packed_seq_params=...): the rotary length of "
                                 "packed sequences is their longest one; set max_seqlen_q and max_seqlen_kv")
            return max(int(bound) for bound in bounds)
        inference_context = inference_params if inference_params is not None else inference_context
        if inference_context is not None:
            seq_len = inference_context.max_sequence_length
        else:
            received = getattr(transformer, "input_tensor", None)
            seq_len = (received if received is not None else transformer_input).size(0)
            if transformer_config.sequence_parallel:
                seq_len *= transformer_config.tensor_model_parallel_size
        return seq_len * transformer_config.context_parallel_size

    def __deepcopy__(self, memo):
        # A process group cannot be copied: the copy computes its share over the same group.
        if self.cp_group is not None:
            memo.setdefault(id(self.cp_group), self.cp_group)
        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = torch.chunk(x, 2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotate_interleaved_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, config=None, cu_seqlens=None, mscale: float = 1.0,
                         cp_group=None, *, interleaved=None) -> torch.Tensor:
    """Rotates the first `freqs.shape[-1]` channels of `t` (`[s, b, heads, head_dim]`) by the angles `freqs`
    (`RotaryEmbedding`'s output), with cos and sin multiplied by `mscale` (YaRN's attention factor; 1 for plain
    RoPE). Upstream's signature: with a `config`, its `rotary_interleaved` picks the pair layout and with its
    `multi_latent_attention` the rotated channels' even ones are gathered before the odd ones first (upstream's
    layout for multi-latent attention); without one, `interleaved` pairs channels (2i, 2i + 1) (angles from a
    `RotaryEmbedding(rotary_interleaved=True)`) instead of (i, i + rot_dim / 2).

    With `cu_seqlens` (packed sequences, upstream's THD layout): `t` is `[t, heads, head_dim]` (or
    `[t, 1, heads, head_dim]`), sequences lie back to back at those offsets, and row r of a sequence starting at
    row s is rotated by `freqs[r - s]`. `cp_group` (upstream's, for packed sequences split across
    context-parallel ranks) must then be None or a single rank."""
    if cu_seqlens is not None:
        if cp_group is not None and dist.get_world_size(cp_group) > 1:
            raise ValueError("apply_rotary_pos_emb(cu_seqlens=..., cp_group=...): packed sequences split across "
                             "context-parallel ranks are not supported; pass whole packed sequences")
        positions = rotary_positions_from_cu_seqlens(cu_seqlens, t.shape[0])
        if positions.numel() and int(positions.max()) >= freqs.shape[0]:
            raise ValueError(f"apply_rotary_pos_emb(cu_seqlens=...): a packed sequence is longer than the "
                             f"{freqs.shape[0]} positions of freqs; compute the angles of the longest sequence")
        rows = packed_rotary_angles(freqs, positions)
        if t.dim() == 3:
            return apply_rotary_pos_emb(t.unsqueeze(1), rows, config, None, mscale, interleaved=interleaved)[:, 0]
        return apply_rotary_pos_emb(t, rows, config, None, mscale, interleaved=interleaved)
    regroup = False
    if config is not None:
        if interleaved is not None:
            raise ValueError("apply_rotary_pos_emb: pass either a config (its rotary_interleaved picks the pair "
                             "layout) or interleaved=, not both")
        interleaved = config.rotary_interleaved
        regroup = bool(getattr(config, "multi_latent_attention", False))
    rot_dim = freqs.shape[-1]
    rotated, passthrough = t[..., :rot_dim], t[..., rot_dim:]
    rotated_fp32 = rotated.float()
    if regroup:
        rotated_fp32 = torch.cat((rotated_fp32[..., 0::2], rotated_fp32[..., 1::2]), dim=-1)
    rotate = _rotate_interleaved_pairs if interleaved else _rotate_half
    cos, sin = freqs.cos(), freqs.sin()
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    rotated_fp32 = rotated_fp32 * cos + rotate(rotated_fp32) * sin
    return torch.cat((rotated_fp32.to(t.dtype), passthrough), dim=-1)

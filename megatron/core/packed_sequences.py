"""Packed (THD) sequences: several sequences laid back to back in one row, described by `PackedSeqParams`.

Upstream's layout: the batch is one row (`input_ids` `[1, t]`, hidden states `[t, 1, h]`); `cu_seqlens_q` holds
the sequences' cumulative lengths (`[0, l_0, l_0 + l_1, ...]`). With `cu_seqlens_q_padded`, sequence i starts at
row `cu_seqlens_q_padded[i]`, its `l_i` tokens come first and the rows up to the next start are padding. Rows past
the last offset are padding too.

Here a packed row runs as one sequence under two rules that make each packed sequence see only itself:
- a block-diagonal causal mask: a token attends to the earlier tokens of its own sequence, a padding row to
  itself only (its output is never read by a real token);
- positions restarting at 0 at each sequence start, for the rotary angles and the learned position embedding.
A token's loss then equals the loss it has when its sequence runs alone, and the gradient of a packed row is the
sum of its sequences' gradients (see tests/unit_tests/models/gpt/test_gpt_packed_sequences.py). Masking the last
token of each sequence (whose label belongs to the next one) and the padding is the loss mask's job, as upstream.

The mask is `[1, 1, t, t]` bools, built once per `PackedSeqParams` object and shared by the layers
(`packed_rows`). Multi-token prediction shifts its inputs and labels within each sequence
(`shift_left_within_sequences`).
"""

from typing import NamedTuple

import torch

from megatron.core.packed_seq_params import PackedSeqParams


def _offsets(params: PackedSeqParams, name: str):
    query, key = getattr(params, f"cu_seqlens_q{name}"), getattr(params, f"cu_seqlens_kv{name}")
    if key is not None and (query is None or not torch.equal(query.cpu(), key.cpu())):
        raise ValueError(f"packed_seq_params: cu_seqlens_kv{name} must equal cu_seqlens_q{name} (self-attention "
                         f"attends within each sequence); pass the same offsets for both")
    return None if query is None else [int(offset) for offset in query.tolist()]


def sequence_rows(params: PackedSeqParams, total_len: int):
    """[(start row, real length)] of each packed sequence in a row of `total_len` tokens, after checking
    `params` (see the module docstring); raises ValueError naming the field to fix."""
    if not isinstance(params, PackedSeqParams):
        raise TypeError(f"packed_seq_params must be a megatron.core.packed_seq_params.PackedSeqParams, got "
                        f"{type(params).__name__}")
    if params.qkv_format not in (None, "thd"):
        raise ValueError(f"packed_seq_params.qkv_format={params.qkv_format!r} is not supported: packed sequences "
                         "run in the 'thd' layout (one row [1, t]); for padded [b, s] batches pass "
                         "packed_seq_params=None and mask the padding with loss_mask")
    offsets = _offsets(params, "")
    if offsets is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is None: give the sequences' cumulative lengths "
                         "[0, l_0, l_0 + l_1, ...]")
    padded = _offsets(params, "_padded")
    if offsets[0] != 0 or (padded is not None and padded[0] != 0):
        raise ValueError("packed_seq_params: cu_seqlens_q (and cu_seqlens_q_padded) must start at 0")
    lengths = [end - start for start, end in zip(offsets[:-1], offsets[1:])]
    starts = offsets[:-1] if padded is None else padded[:-1]
    if padded is not None:
        if len(padded) != len(offsets):
            raise ValueError(f"packed_seq_params: cu_seqlens_q_padded has {len(padded)} offsets and cu_seqlens_q "
                             f"{len(offsets)}: give one padded offset per sequence offset")
        short = [i for i, length in enumerate(lengths) if padded[i + 1] - padded[i] < length]
        if short:
            raise ValueError(f"packed_seq_params: sequence {short[0]} has {lengths[short[0]]} tokens but "
                             f"{padded[short[0] + 1] - padded[short[0]]} padded rows in cu_seqlens_q_padded: "
                             "each padded length must be at least the sequence's length")
    end = offsets[-1] if padded is None else padded[-1]
    if end > total_len:
        raise ValueError(f"packed_seq_params: the sequences end at row {end} but the packed row has {total_len} "
                         "tokens; pass input_ids of shape [1, t] with t at least the last offset")
    longest = max(lengths, default=0)
    for name in ("max_seqlen_q", "max_seqlen_kv"):
        bound = getattr(params, name)
        if bound is not None and int(bound) < longest:
            raise ValueError(f"packed_seq_params.{name}={int(bound)} is below the longest sequence ({longest} "
                             "tokens); pass the longest sequence's length")
    return list(zip(starts, lengths))


def packed_segments_and_positions(params: PackedSeqParams, total_len: int, device=None):
    """(segment id `[t]`, position within its sequence `[t]`), int64. Real tokens of sequence i have segment i
    and positions 0 .. l_i - 1; each padding row has a segment of its own (negative) and position 0 (its output
    is never read by a real token, so its position only has to exist in every table of angles)."""
    segments = -1 - torch.arange(total_len, dtype=torch.int64)
    positions = torch.zeros(total_len, dtype=torch.int64)
    for index, (start, length) in enumerate(sequence_rows(params, total_len)):
        segments[start:start + length] = index
        positions[start:start + length] = torch.arange(length, dtype=torch.int64)
    return segments.to(device), positions.to(device)


def packed_attention_mask(segments: torch.Tensor) -> torch.Tensor:
    """Megatron's bool mask `[1, 1, t, t]`, True where attention is NOT allowed: a row sees the rows at or before
    it with the same segment id (see `packed_segments_and_positions`)."""
    total_len = segments.shape[0]
    future = torch.ones(total_len, total_len, dtype=torch.bool, device=segments.device).triu(1)
    return ((segments[:, None] != segments[None, :]) | future)[None, None]


def packed_rotary_angles(angles: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The rotary angles of each packed row: `angles` `[n, 1, 1, d]` of positions 0 .. n - 1 (n above the largest
    position), picked by `positions` `[t]` -> `[t, 1, 1, d]`."""
    return angles.index_select(0, positions.to(angles.device))


def rotary_positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total_len: int) -> torch.Tensor:
    """Each row's position within its sequence for sequences packed back to back at `cu_seqlens` (no padding
    offsets; rows past the last offset: 0), `[total_len]` int64 (upstream's `apply_rotary_pos_emb(cu_seqlens=...)`)."""
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens)
    return packed_segments_and_positions(params, total_len)[1]


class PackedRows(NamedTuple):
    """What a packed row's layers share: `segments` and `positions` `[t]` (see `packed_segments_and_positions`),
    the block-diagonal causal `mask` `[1, 1, t, t]` and the `longest` sequence's length."""

    segments: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    longest: int


def check_packed_model_support(where, config, decoding: bool):
    """Raises ValueError naming what `where` (e.g. "GPTModel.forward") cannot combine packed sequences with."""
    if decoding:
        raise ValueError(f"{where}(packed_seq_params=...): decoding (inference_context) runs padded [b, s] prompts; "
                         "pass packed_seq_params=None")
    if config.context_parallel_size > 1:
        raise ValueError(f"{where}(packed_seq_params=...): context parallelism (--context-parallel-size "
                         f"{config.context_parallel_size}) splits one padded sequence into chunks across ranks; split "
                         "the packed sequences across data-parallel ranks instead, or run context parallelism on "
                         "padded [b, s] batches")


def packed_rows(where, params: PackedSeqParams, total_len: int, batch: int, device) -> PackedRows:
    """The `PackedRows` of a packed row of `total_len` tokens on `device`. They are computed once per `params`
    object, row length and device, and kept on `params`: every layer of a forward (and its backward) reads the
    same tensors, and the offsets are read on the host once. Build a new `PackedSeqParams` for each batch (as
    upstream's data code does) rather than changing the offsets of one in place."""
    if batch != 1:
        raise ValueError(f"{where}(packed_seq_params=...): packed sequences lie in one row, but the batch has "
                         f"{batch} rows; pass input_ids of shape [1, t] (hidden states [t, 1, h])")
    cache = params.__dict__.setdefault("_packed_rows", {})
    key = (total_len, str(device))
    if key not in cache:
        longest = max((length for _, length in sequence_rows(params, total_len)), default=0)
        segments, positions = packed_segments_and_positions(params, total_len, device=device)
        cache[key] = PackedRows(segments, positions, packed_attention_mask(segments), longest)
    return cache[key]


def packed_attention_inputs(where, params: PackedSeqParams, config, hidden_states, attention_mask, decoding=False):
    """(attention mask, `PackedRows`) for an attention given `packed_seq_params`: `hidden_states` `[t, 1, h]`
    (`[t / tp, 1, h]` with sequence parallelism); the block-diagonal causal mask, combined with `attention_mask`
    (True where masked) when one is given."""
    check_packed_model_support(where, config, decoding)
    total_len = hidden_states.shape[0] * (config.tensor_model_parallel_size if config.sequence_parallel else 1)
    rows = packed_rows(where, params, total_len, hidden_states.shape[1], hidden_states.device)
    if attention_mask is None:
        return rows.mask, rows
    return rows.mask | attention_mask.to(device=rows.mask.device, dtype=torch.bool), rows


def rows_rotary_angles(where, angles: torch.Tensor, rows: PackedRows) -> torch.Tensor:
    """Each packed row's rotary angles `[t, 1, 1, d]` from `angles` `[n, 1, 1, d]` of positions 0 .. n - 1 (n at
    least the longest sequence, upstream's `get_rotary_seq_len`)."""
    if rows.longest > angles.shape[0]:
        raise ValueError(f"{where}(packed_seq_params=...): rotary_pos_emb holds the angles of {angles.shape[0]} "
                         f"positions but a packed sequence has {rows.longest} tokens; compute them for "
                         "max(max_seqlen_q, max_seqlen_kv) positions (get_rotary_seq_len)")
    return packed_rotary_angles(angles, rows.positions)


def shift_left_within_sequences(tensor: torch.Tensor, shift: int, segments: torch.Tensor, fill=0):
    """(`tensor` `[..., t]` moved `shift` rows to the left within each packed sequence, the rows whose source lies
    past their sequence's end filled with `fill`; bool `[t]`, True where the source row is in the same sequence)
    (multi-token prediction on packed sequences: each sequence shifted as if alone)."""
    total_len = segments.shape[0]
    source = torch.arange(total_len, device=segments.device) + shift
    inside = source < total_len
    source = source.clamp(max=total_len - 1)
    valid = inside & (segments[source] == segments) & (segments >= 0)
    shifted = tensor.index_select(-1, source.to(tensor.device))
    fill_value = torch.full_like(shifted, fill)
    return torch.where(valid.to(tensor.device), shifted, fill_value), valid

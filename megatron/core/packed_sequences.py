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

The mask is `[1, 1, t, t]` bools, built once per forward and shared by the layers.
"""

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



def check_packed_model_support(where, config, runs_mtp: bool, decoding: bool):
    """Raises ValueError naming what `where` (e.g. "GPTModel.forward") cannot combine packed sequences with."""
    refusals = (
        (decoding, "decoding (inference_context) runs padded [b, s] prompts; pass packed_seq_params=None"),
        (config.context_parallel_size > 1,
         f"context parallelism (--context-parallel-size {config.context_parallel_size}) splits one padded "
         "sequence into chunks across ranks; split the packed sequences across data-parallel ranks instead, or "
         "run context parallelism on padded [b, s] batches"),
        (bool(getattr(config, "multi_latent_attention", False)),
         "multi-latent attention computes its rotary angles from row positions, not per packed sequence; pass "
         "padded [b, s] batches"),
        (runs_mtp, "multi-token prediction shifts labels across the whole row, over the packed sequences' "
                   "boundaries; pass padded [b, s] batches or drop --mtp-num-layers"),
    )
    for refused, why in refusals:
        if refused:
            raise ValueError(f"{where}(packed_seq_params=...): {why}")


def packed_forward_inputs(where, params: PackedSeqParams, total_len: int, batch: int, attention_mask, device):
    """(attention mask, positions `[t]`) of a packed row of `total_len` tokens: the block-diagonal causal mask,
    combined with `attention_mask` (True where masked) when one is given, and each row's position within its
    sequence."""
    if batch != 1:
        raise ValueError(f"{where}(packed_seq_params=...): packed sequences lie in one row, but the batch has "
                         f"{batch} rows; pass input_ids of shape [1, t] (hidden states [t, 1, h])")
    segments, positions = packed_segments_and_positions(params, total_len, device=device)
    mask = packed_attention_mask(segments)
    if attention_mask is not None:
        mask = mask | attention_mask.to(device=device, dtype=torch.bool)
    return mask, positions


def packed_layer_inputs(where, params: PackedSeqParams, config, hidden_states, attention_mask, rotary_pos_emb,
                        decoding=False):
    """(attention mask, rotary angles of each row) for a transformer block, layer or attention called with
    `packed_seq_params` as upstream calls them: `hidden_states` `[t, 1, h]` (`[t / tp, 1, h]` with sequence
    parallelism) and `rotary_pos_emb` the angles of positions 0 .. n - 1, n at least the longest sequence
    (upstream's `get_rotary_seq_len`), or None."""
    check_packed_model_support(where, config, runs_mtp=False, decoding=decoding)
    total_len = hidden_states.shape[0] * (config.tensor_model_parallel_size if config.sequence_parallel else 1)
    mask, positions = packed_forward_inputs(where, params, total_len, hidden_states.shape[1], attention_mask,
                                            hidden_states.device)
    if rotary_pos_emb is not None:
        longest = int(positions.max()) + 1 if positions.numel() else 0
        if longest > rotary_pos_emb.shape[0]:
            raise ValueError(f"{where}(packed_seq_params=...): rotary_pos_emb holds the angles of "
                             f"{rotary_pos_emb.shape[0]} positions but a packed sequence has {longest} tokens; "
                             "compute them for max(max_seqlen_q, max_seqlen_kv) positions (get_rotary_seq_len)")
        rotary_pos_emb = packed_rotary_angles(rotary_pos_emb, positions)
    return mask, rotary_pos_emb

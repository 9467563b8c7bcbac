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

The mask is `[1, 1, t, t]` bools, built once per `PackedSeqParams` object when first needed and shared by the
layers (`packed_rows`); plain causal attention runs one sequence at a time without it
(megatron/core/transformer/packed_attention.py). Multi-token prediction shifts its inputs and labels within each sequence
(`shift_left_within_sequences`).

Under context parallelism a rank holds upstream's THD split of the row (`thd_local_indices`: two chunks of every
sequence) while the context-parallel attention reads masks over the positions of its standard split (two chunks
of the whole row). The packed mask is therefore re-indexed once, so that each standard position stands for the
packed row the rank holds there; every comm type then computes the exact packed attention.
"""

import weakref
from collections import OrderedDict

import torch

from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.context_parallel.sequence_split import local_token_indices


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


class PackedRows:
    """What a packed row's layers share: `segments` and `positions` `[t]` (see `packed_segments_and_positions`),
    the `longest` sequence's length, `runs` (without context parallelism: the (first row, row count) of each
    sequence and each stretch of padding, in row order, covering the row) and the block-diagonal causal `mask`
    `[1, 1, t, t]`, built when first read (an attention that runs per sequence never needs it). `arrange` puts a
    mask over the packed row in the order the attention reads it (identity without context parallelism)."""

    def __init__(self, segments, positions, longest, runs, arrange):
        self.segments, self.positions, self.longest, self.runs = segments, positions, longest, runs
        self._arrange, self._masks = arrange, {}

    @property
    def mask(self) -> torch.Tensor:
        return self.mask_for_window(None)

    def mask_for_window(self, window_size) -> torch.Tensor:
        """The mask with a sliding window (`window_size` (left, right), None for none) applied within each
        sequence: rows of one sequence are as far apart as their positions, so the window is applied over the
        packed row before it is arranged for the attention."""
        key = None if window_size is None else tuple(window_size)
        if key not in self._masks:
            mask = packed_attention_mask(self.segments)
            if key is not None:  # attention_variants.window_blocked's rule, over the packed row
                rows = torch.arange(self.segments.shape[0], device=self.segments.device)
                offset = rows[:, None] - rows[None, :]
                left, right = key
                if left >= 0:
                    mask = mask | (offset > left)[None, None]
                if right >= 0:
                    mask = mask | (offset < -right)[None, None]
            self._masks[key] = self._arrange(mask)
        return self._masks[key]


def context_parallel_size_and_rank(config):
    """(context-parallel size, this rank's index in its group) of `config`'s model: (1, 0) without."""
    if config.context_parallel_size == 1:
        return 1, 0
    return config.context_parallel_size, parallel_state.get_context_parallel_rank()


def check_packed_model_support(where, config, decoding: bool, runs_mtp: bool = False):
    """Raises ValueError naming what `where` (e.g. "GPTModel.forward") cannot combine packed sequences with."""
    if decoding:
        raise ValueError(f"{where}(packed_seq_params=...): decoding (inference_context) runs padded [b, s] prompts; "
                         "pass packed_seq_params=None")
    if config.context_parallel_size == 1:
        return
    if runs_mtp:
        raise ValueError(f"{where}(packed_seq_params=...): multi-token prediction (--mtp-num-layers) on packed "
                         "sequences is not supported under context parallelism (--context-parallel-size "
                         f"{config.context_parallel_size}); run it without context parallelism or on padded [b, s] "
                         "batches")


def thd_local_indices(params: PackedSeqParams, total_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The rows of a packed row of `total_len` tokens that context-parallel rank `cp_rank` of `cp_size` holds, in
    its order (upstream's THD split, Transformer Engine's `thd_get_partitioned_indices`): each sequence's span
    (from its start to the next one's, padding included) is cut into 2 x CP equal chunks and the rank takes chunks
    `cp_rank` and `2 x CP - 1 - cp_rank` of every sequence, sequence after sequence. Each span must be a multiple
    of 2 x CP rows and the last one must end the row (pad the sequences with `cu_seqlens_q_padded`)."""
    rows = sequence_rows(params, total_len)
    starts = [start for start, _ in rows] + [total_len]
    offsets = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    if int(offsets[-1]) != total_len:
        raise ValueError(f"packed_seq_params: under context parallelism the sequences must fill the row: they end "
                         f"at row {int(offsets[-1])} of {total_len}; pad the last one (cu_seqlens_q_padded)")
    pieces = []
    for index in range(len(rows)):
        span = starts[index + 1] - starts[index]
        if span % (2 * cp_size):
            raise ValueError(f"packed_seq_params: sequence {index} spans {span} rows, not a multiple of 2 x "
                             f"--context-parallel-size ({2 * cp_size}); pad each sequence to a multiple of "
                             f"{2 * cp_size} rows with cu_seqlens_q_padded (as upstream requires)")
        chunk = span // (2 * cp_size)
        for chunk_id in (cp_rank, 2 * cp_size - 1 - cp_rank):
            first = starts[index] + chunk_id * chunk
            pieces.append(torch.arange(first, first + chunk, dtype=torch.int64))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def _rows_in_standard_order(mask, params, total_len, cp_size):
    """`mask` `[1, 1, t, t]` over packed rows, re-indexed for the context-parallel attention: it reads masks over
    the positions of the standard split (rank r holding chunks r and 2N - 1 - r of the whole row), so the row at
    standard position p is the packed row that sits there under the THD split."""
    standard = torch.cat([local_token_indices(total_len, cp_size, rank) for rank in range(cp_size)])
    packed = torch.cat([thd_local_indices(params, total_len, cp_size, rank) for rank in range(cp_size)])
    rows_at = torch.empty(total_len, dtype=torch.int64)
    rows_at[standard] = packed
    rows_at = rows_at.to(mask.device)
    return mask.index_select(-2, rows_at).index_select(-1, rows_at)


def _runs(sequences, total_len):
    """[(first row, row count)] of each sequence's real tokens and of each stretch of padding, in row order."""
    runs, row = [], 0
    for start, length in sequences:
        if start > row:
            runs.append((row, start - row))
        if length:
            runs.append((start, length))
        row = start + length
    if total_len > row:
        runs.append((row, total_len - row))
    return runs


# The `PackedRows` of the most recently used `PackedSeqParams` objects: enough for the microbatches a pipeline
# schedule keeps in flight, and a bound on the masks held (a [t, t] mask each) whatever the caller keeps.
ROWS_CACHE_SIZE = 8
_ROWS_CACHE: "OrderedDict[tuple, tuple]" = OrderedDict()


def packed_rows(where, params: PackedSeqParams, local_len: int, batch: int, device, cp_size: int = 1,
                cp_rank: int = 0) -> PackedRows:
    """The `PackedRows` of a packed row of which this rank holds `local_len` tokens on `device`. They are
    computed once per `params` object, row length, device and context-parallel rank and kept while that object is
    among the last `ROWS_CACHE_SIZE` used: every layer of a forward (and its backward) reads the same tensors, and
    the offsets are read on the host once. Build a new `PackedSeqParams` for each batch (as upstream's data code
    does) rather than changing the offsets of one in place.

    Under context parallelism (`cp_size` > 1) the rank holds its rows of upstream's THD split
    (`thd_local_indices`): `positions` are those of its own rows, and `mask` covers the whole row re-indexed as
    the context-parallel attention reads it (`_rows_in_standard_order`)."""
    if batch != 1:
        raise ValueError(f"{where}(packed_seq_params=...): packed sequences lie in one row, but the batch has "
                         f"{batch} rows; pass input_ids of shape [1, t] (hidden states [t, 1, h])")
    key = (id(params), local_len, str(device), cp_size, cp_rank)
    cached = _ROWS_CACHE.get(key)
    if cached is not None and cached[0]() is params:  # the same object, not another one at a reused address
        _ROWS_CACHE.move_to_end(key)
        return cached[1]
    total_len = local_len * cp_size
    sequences = sequence_rows(params, total_len)
    longest = max((length for _, length in sequences), default=0)
    segments, positions = packed_segments_and_positions(params, total_len, device=device)
    if cp_size > 1:
        positions = positions[thd_local_indices(params, total_len, cp_size, cp_rank).to(device)]
        rows = PackedRows(segments, positions, longest, None,
                          lambda mask: _rows_in_standard_order(mask, params, total_len, cp_size))
    else:
        rows = PackedRows(segments, positions, longest, _runs(sequences, total_len), lambda mask: mask)
    _ROWS_CACHE[key] = (weakref.ref(params), rows)
    while len(_ROWS_CACHE) > ROWS_CACHE_SIZE:
        _ROWS_CACHE.popitem(last=False)
    return rows


def packed_attention_rows(where, params: PackedSeqParams, config, hidden_states, decoding=False):
    """The `PackedRows` for an attention given `packed_seq_params`: `hidden_states` `[t, 1, h]` (`[t / tp, 1, h]`
    with sequence parallelism, `[t / cp, 1, h]` this rank's THD rows under context parallelism)."""
    check_packed_model_support(where, config, decoding)
    local_len = hidden_states.shape[0] * (config.tensor_model_parallel_size if config.sequence_parallel else 1)
    return packed_rows(where, params, local_len, hidden_states.shape[1], hidden_states.device,
                       *context_parallel_size_and_rank(config))


def packed_attention_mask_with(rows: PackedRows, attention_mask, window_size=None):
    """The block-diagonal causal mask of `rows` (with the sliding window `window_size` applied within each sequence
    when given), combined with `attention_mask` (True where masked) if given."""
    mask = rows.mask_for_window(window_size)
    if attention_mask is None:
        return mask
    return mask | attention_mask.to(device=mask.device, dtype=torch.bool)


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


# Batch entries that are not indexed by token along dimension 1.
_NOT_PER_TOKEN = ("attention_mask", "cu_seqlens", "cu_seqlens_padded", "max_seqlen")


def get_thd_batch_on_this_cp_rank(batch: dict, cu_seqlens, cu_seqlens_padded=None, max_seqlen=None, cp_size=None,
                                  cp_rank=None):
    """(batch, packed_seq_params) of one packed micro-batch (upstream's name and order): the `[1, t]` entries of
    `batch` (tokens, labels, loss mask, position ids) cut to this context-parallel rank's THD rows
    (`thd_local_indices`), in place, and the `PackedSeqParams` of the whole row to pass to the model with them.
    `cu_seqlens_padded` places the sequences at padded offsets (each span a multiple of 2 x CP rows);
    `max_seqlen` defaults to the longest sequence. The sizes default to parallel_state's context-parallel group."""
    offsets = torch.as_tensor(cu_seqlens).to(torch.int32)
    padded = None if cu_seqlens_padded is None else torch.as_tensor(cu_seqlens_padded).to(torch.int32)
    longest = (int(torch.as_tensor(max_seqlen).max()) if max_seqlen is not None
               else int((offsets[1:] - offsets[:-1]).max()) if offsets.numel() > 1 else 0)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=offsets, cu_seqlens_kv=offsets, cu_seqlens_q_padded=padded,
                             cu_seqlens_kv_padded=padded, max_seqlen_q=longest, max_seqlen_kv=longest)
    return cut_packed_batch_for_cp_rank(batch, params, cp_size, cp_rank), params


def cut_packed_batch_for_cp_rank(batch: dict, params: PackedSeqParams, cp_size=None, cp_rank=None) -> dict:
    """`batch`'s `[1, t]` entries cut, in place, to this context-parallel rank's THD rows of the packed row that
    `params` describes (`thd_local_indices`); the sizes default to parallel_state's context-parallel group."""
    if cp_size is None or cp_rank is None:
        cp_size = parallel_state.get_context_parallel_world_size()
        cp_rank = parallel_state.get_context_parallel_rank()
    if cp_size == 1:
        return batch
    per_token = {key: value for key, value in batch.items()
                 if isinstance(value, torch.Tensor) and value.dim() >= 2 and key not in _NOT_PER_TOKEN}
    lengths = {value.shape[1] for value in per_token.values()}
    if len(lengths) != 1:
        raise ValueError(f"a packed batch's [1, t] entries have lengths {sorted(lengths)}; give tokens, labels, loss "
                         "mask and position ids of one packed row")
    rows = thd_local_indices(params, lengths.pop(), cp_size, cp_rank)
    for key, value in per_token.items():
        batch[key] = value.index_select(1, rows.to(value.device))
    return batch

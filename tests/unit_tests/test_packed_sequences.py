"""The rows, positions and mask of packed (THD) sequences, the shift of multi-token prediction within them, and the
inputs they are refused with."""

import pytest
import torch

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.packed_sequences import (
    ROWS_CACHE_SIZE,
    check_packed_model_support,
    get_thd_batch_on_this_cp_rank,
    packed_attention_mask,
    packed_attention_mask_with,
    packed_attention_rows,
    packed_rows,
    packed_segments_and_positions,
    sequence_rows,
    shift_left_within_sequences,
    thd_local_indices,
)
from tests.unit_tests.models.gpt.gpt_test_utils import tiny_config


def _padded_params():
    """Sequences of 3, 2 and 4 tokens at rows 0, 4 and 8 (padded to 4 rows each), in a row of 14."""
    return PackedSeqParams(cu_seqlens_q=torch.tensor([0, 3, 5, 9], dtype=torch.int32),
                           cu_seqlens_q_padded=torch.tensor([0, 4, 8, 12], dtype=torch.int32))


def test_padded_sequences_get_their_rows_positions_and_segments():
    params = _padded_params()
    assert sequence_rows(params, 14) == [(0, 3), (4, 2), (8, 4)]
    segments, positions = packed_segments_and_positions(params, 14)
    # Padding rows (3, 6, 7, 12, 13) each get a segment of their own and position 0.
    assert segments.tolist() == [0, 0, 0, -4, 1, 1, -7, -8, 2, 2, 2, 2, -13, -14]
    assert positions.tolist() == [0, 1, 2, 0, 0, 1, 0, 0, 0, 1, 2, 3, 0, 0]


def test_the_mask_lets_each_row_see_its_own_sequence_up_to_itself():
    segments, _ = packed_segments_and_positions(_padded_params(), 14)
    mask = packed_attention_mask(segments)
    assert mask.shape == (1, 1, 14, 14) and mask.dtype == torch.bool
    allowed = {(query, key) for query in range(14) for key in range(14) if not mask[0, 0, query, key]}
    sequences = [range(0, 3), range(4, 6), range(8, 12)]
    expected = {(query, key) for rows in sequences for query in rows for key in rows if key <= query}
    expected |= {(row, row) for row in (3, 6, 7, 12, 13)}  # padding: itself only
    assert allowed == expected


def test_unpadded_offsets_and_a_given_mask_combine():
    offsets = torch.tensor([0, 2, 5])
    params = PackedSeqParams(cu_seqlens_q=offsets, cu_seqlens_kv=offsets.clone(), max_seqlen_q=3, max_seqlen_kv=3)
    extra = torch.zeros(1, 1, 6, 6, dtype=torch.bool)
    extra[..., 4, 3] = True  # one more pair masked inside the second sequence
    rows = packed_attention_rows("SelfAttention", params, tiny_config(), torch.zeros(6, 1, 32))
    mask = packed_attention_mask_with(rows, extra)
    assert rows.positions.tolist() == [0, 1, 0, 1, 2, 0] and rows.longest == 3  # row 5, past the end, is padding
    assert rows.runs == [(0, 2), (2, 3), (5, 1)]  # the two sequences, then the padding
    assert not mask[0, 0, 4, 2] and mask[0, 0, 4, 3] and not mask[0, 0, 4, 4] and mask[0, 0, 2, 1]
    assert mask.sum() == rows.mask.sum() + 1
    # Under sequence parallelism a rank holds t / tp rows of the same packed row.
    split = packed_attention_rows("SelfAttention", params, tiny_config(tp=2, sequence_parallel=True),
                                  torch.zeros(3, 1, 32))
    assert split is rows  # computed once per params object, row length and device


def test_multi_token_prediction_shifts_within_each_sequence():
    segments, _ = packed_segments_and_positions(_padded_params(), 14)
    values = torch.arange(100, 114)[None]
    shifted, valid = shift_left_within_sequences(values, 2, segments, fill=-1)
    # Sequence rows 0-2, 4-5 and 8-11: a row keeps the value two rows on only inside its own sequence.
    assert shifted.tolist() == [[102, -1, -1, -1, -1, -1, -1, -1, 110, 111, -1, -1, -1, -1]]
    assert valid.tolist() == [value != -1 for value in shifted[0].tolist()]


@pytest.mark.parametrize("fields, total_len, message", [
    (dict(qkv_format="sbhd", cu_seqlens_q=torch.tensor([0, 4])), 4, r"qkv_format='sbhd' is not supported"),
    (dict(cu_seqlens_q=None), 4, r"cu_seqlens_q is None"),
    (dict(cu_seqlens_q=torch.tensor([0, 4]), cu_seqlens_kv=torch.tensor([0, 3])), 4,
     r"cu_seqlens_kv must equal cu_seqlens_q"),
    (dict(cu_seqlens_q=torch.tensor([1, 4])), 4, r"must start at 0"),
    (dict(cu_seqlens_q=torch.tensor([0, 3, 6])), 5, r"end at row 6 but the packed row has 5 tokens"),
    (dict(cu_seqlens_q=torch.tensor([0, 3, 6]), cu_seqlens_q_padded=torch.tensor([0, 2, 6])), 6,
     r"sequence 0 has 3 tokens but 2 padded rows"),
    (dict(cu_seqlens_q=torch.tensor([0, 3, 6]), cu_seqlens_q_padded=torch.tensor([0, 6])), 6,
     r"cu_seqlens_q_padded has 2 offsets and cu_seqlens_q 3"),
    (dict(cu_seqlens_q=torch.tensor([0, 3, 8]), max_seqlen_q=4), 8, r"max_seqlen_q=4 is below the longest"),
])
def test_inconsistent_offsets_are_refused_naming_the_field(fields, total_len, message):
    with pytest.raises(ValueError, match=message):
        sequence_rows(PackedSeqParams(**fields), total_len)


def test_a_batch_of_several_rows_and_unsupported_models_are_refused():
    params = PackedSeqParams(cu_seqlens_q=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"packed sequences lie in one row, but the batch has 2 rows"):
        packed_rows("GPTModel.forward", params, 4, 2, None)
    with pytest.raises(TypeError, match=r"must be a megatron.core.packed_seq_params.PackedSeqParams"):
        sequence_rows({"cu_seqlens_q": [0, 4]}, 4)
    context_parallel = tiny_config(context_parallel_size=2)
    cases = [
        (dict(config=context_parallel, runs_mtp=True), r"multi-token prediction \(--mtp-num-layers\) on packed "
                                                       r"sequences is not supported under context parallelism"),
        (dict(config=tiny_config(), decoding=True), r"decoding \(inference_context\)"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=r"GPTModel.forward\(packed_seq_params=...\): " + message):
            check_packed_model_support("GPTModel.forward", **dict(dict(decoding=False), **kwargs))
    check_packed_model_support("GPTModel.forward", tiny_config(), False, runs_mtp=True)
    check_packed_model_support("GPTModel.forward", context_parallel, False)


def test_context_parallel_ranks_take_two_chunks_of_every_sequence():
    """Upstream's THD split at CP 2: spans of 8, 4 and 4 rows in chunks of 2, 1 and 1; rank 0 takes chunks 0 and
    3 of each, rank 1 chunks 1 and 2."""
    params = PackedSeqParams(cu_seqlens_q=torch.tensor([0, 5, 8, 12]),
                             cu_seqlens_q_padded=torch.tensor([0, 8, 12, 16]))
    assert thd_local_indices(params, 16, 2, 0).tolist() == [0, 1, 6, 7, 8, 11, 12, 15]
    assert thd_local_indices(params, 16, 2, 1).tolist() == [2, 3, 4, 5, 9, 10, 13, 14]
    tokens = torch.arange(100, 116)[None]
    batch, made = get_thd_batch_on_this_cp_rank({"tokens": tokens, "labels": tokens + 1},
                                                params.cu_seqlens_q, params.cu_seqlens_q_padded, cp_size=2, cp_rank=1)
    assert batch["tokens"].tolist() == [[102, 103, 104, 105, 109, 110, 113, 114]]
    assert batch["labels"].tolist() == [[103, 104, 105, 106, 110, 111, 114, 115]]
    assert made.cu_seqlens_q_padded.tolist() == [0, 8, 12, 16] and made.max_seqlen_q == 5
    # Rank 1's rows: positions within their sequences, and the mask re-indexed for the standard split (its rows
    # 4-11 are the standard positions of rank 1), so that row 4 there is packed row 2 (sequence 0, position 2).
    rows = packed_rows("GPTModel.forward", params, 8, 1, "cpu", cp_size=2, cp_rank=1)
    assert rows.positions.tolist() == [2, 3, 4, 0, 1, 2, 1, 2]  # row 5 is sequence 0's padding
    whole = packed_rows("GPTModel.forward", params, 16, 1, "cpu")
    assert torch.equal(rows.mask[0, 0, 4:12][:, 4:12],
                       whole.mask[0, 0][[2, 3, 4, 5, 9, 10, 13, 14]][:, [2, 3, 4, 5, 9, 10, 13, 14]])
    with pytest.raises(ValueError, match=r"sequence 1 spans 3 rows, not a multiple of 2 x --context-parallel-size"):
        thd_local_indices(PackedSeqParams(cu_seqlens_q=torch.tensor([0, 4, 7, 8])), 8, 2, 0)
    with pytest.raises(ValueError, match=r"the sequences must fill the row: they end at row 12 of 16"):
        thd_local_indices(PackedSeqParams(cu_seqlens_q=torch.tensor([0, 4, 12])), 16, 2, 0)


def test_the_rows_of_recent_params_are_kept_and_their_number_bounded():
    first = PackedSeqParams(cu_seqlens_q=torch.tensor([0, 2, 5]))
    rows = packed_rows("GPTModel.forward", first, 5, 1, "cpu")
    assert packed_rows("GPTModel.forward", first, 5, 1, "cpu") is rows  # every layer of a forward
    others = [PackedSeqParams(cu_seqlens_q=torch.tensor([0, 5])) for _ in range(ROWS_CACHE_SIZE)]
    for other in others:
        assert not packed_rows("GPTModel.forward", other, 5, 1, "cpu").mask[0, 0, 4, 0]  # one sequence: row 4 sees 0
    again = packed_rows("GPTModel.forward", first, 5, 1, "cpu")  # pushed out by the later ones: computed again
    assert again is not rows and torch.equal(again.mask, rows.mask) and again.mask[0, 0, 4, 0]


"""Row-aligned layout arithmetic and the copies between the gathered and unsharded forms: every element of every
parameter is owned by exactly one rank, as the rows torch.chunk / Shard(0) give it."""

import math

import pytest
import torch

from megatron_fsdp.layout import GroupLayout, LocalPiece, bucket_by_size, chunk_rows
from megatron_fsdp.resharding import copy_grad_in, copy_gathered_to_unsharded, shard_of_unsharded

SHAPES = [(13, 7), (13,), (0,), (2,), (7, 13), (1, 1, 3), (), (1,), (0, 4)]


def _rows_and_row_numel(shape):
    return (shape[0], math.prod(shape[1:])) if shape else (1, 1)


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4, 5, 6])
def test_each_rank_owns_its_chunk_rows_once(dp_size):
    layout = GroupLayout(SHAPES, dp_size)
    assert layout.numel == sum(math.prod(s) for s in SHAPES)
    # each parameter's chunk is ceil(rows / dp) rows on every rank, padded; shards hold the chunks end to end
    expected_shard = sum(math.ceil(r / dp_size) * n for r, n in map(_rows_and_row_numel, SHAPES))
    assert layout.shard_numel == max(1, expected_shard) and layout.padded_numel == dp_size * layout.shard_numel
    offset = 0
    for index, shape in enumerate(SHAPES):
        rows, row_numel = _rows_and_row_numel(shape)
        chunk = layout.chunks[index]
        assert chunk.shard_offset == offset and chunk.chunk_numel == math.ceil(rows / dp_size) * row_numel
        offset += chunk.chunk_numel
        span = layout.spans[index]
        assert (span.flat_start, span.numel, span.shape) == (dp_size * chunk.shard_offset, math.prod(shape), shape)
        owned = []
        for rank in range(dp_size):
            start, end = chunk_rows(rows, dp_size, rank)
            piece = layout.local_piece(index, rank)
            assert piece == LocalPiece(start * row_numel, end * row_numel, chunk.shard_offset,
                                       chunk.shard_offset + (end - start) * row_numel)
            assert layout.local_shape(index, rank) == (((end - start),) + tuple(shape[1:]) if shape else ())
            owned.extend(range(piece.param_start, piece.param_end))
        assert owned == list(range(math.prod(shape)))


@pytest.mark.parametrize("dp_size,outer_size", [(1, 2), (2, 2), (3, 2), (2, 3), (4, 3), (5, 4)])
def test_sub_shards_split_each_shard_in_equal_flat_ranges(dp_size, outer_size):
    """HFSDP: each shard splits into equal flat sub-shards; the sub-shard pieces of a rank tile its rows."""
    layout = GroupLayout(SHAPES, dp_size, outer_size)
    assert layout.shard_numel == layout.sub_shard_numel * outer_size
    assert layout.shard_numel - layout.used_shard_numel < outer_size  # the tail pad
    for rank in range(dp_size):
        shard_start, shard_end = layout.shard_range(rank)
        covered = []
        for outer_rank in range(outer_size):
            start, end = layout.sub_shard_range(rank, outer_rank)
            assert start - shard_start == layout.sub_shard_offset(outer_rank) and end <= shard_end
            covered.extend(range(start, end))
        assert covered == list(range(shard_start, shard_end))
        for index in range(len(SHAPES)):
            whole = layout.local_piece(index, rank)
            from_sub_shards = []
            for outer_rank in range(outer_size):
                piece = layout.sub_shard_piece(index, rank, outer_rank)
                assert piece == layout.sub_shard_pieces(rank, outer_rank)[index]
                assert 0 <= piece.shard_start <= piece.shard_end <= layout.sub_shard_numel
                if piece.numel:  # the same element, seen from the shard and from the sub-shard
                    assert (layout.sub_shard_offset(outer_rank) + piece.shard_start - whole.shard_start
                            == piece.param_start - whole.param_start)
                from_sub_shards.extend(range(piece.param_start, piece.param_end))
            assert from_sub_shards == list(range(whole.param_start, whole.param_end))


def test_outer_size_one_is_the_plain_layout():
    for dp_size in (1, 2, 3, 5):
        plain, hybrid = GroupLayout(SHAPES, dp_size), GroupLayout(SHAPES, dp_size, 1)
        assert (plain.shard_numel, plain.padded_numel) == (hybrid.shard_numel, hybrid.padded_numel)
        assert hybrid.sub_shard_numel == hybrid.shard_numel
        for rank in range(dp_size):
            assert hybrid.sub_shard_pieces(rank, 0) == plain.local_pieces(rank)


def test_worked_example():
    layout = GroupLayout([(3, 2), (5,), (0,), (4,)], 2)
    # rows per rank 2, 3, 0, 2 -> chunks of 4, 3, 0, 2 elements; shards of 9; 18 elements in all
    assert [c.chunk_numel for c in layout.chunks] == [4, 3, 0, 2] and layout.shard_numel == 9
    assert [(s.flat_start, s.flat_end) for s in layout.spans] == [(0, 6), (8, 13), (14, 14), (14, 18)]
    assert layout.local_piece(0, 1) == LocalPiece(4, 6, 0, 2)  # row 2 of (3, 2): elements 4..5
    assert layout.local_piece(1, 1) == LocalPiece(3, 5, 4, 6)  # rows 3..4 of (5,)
    assert layout.local_piece(3, 0) == LocalPiece(0, 2, 7, 9)
    assert layout.owners_of_param(0) == [0, 1] and layout.owners_of_param(2) == []
    hybrid = GroupLayout([(3, 2), (5,)], 2, 3)  # chunks 4 + 3 = 7 -> shards of 9 (3 sub-shards of 3)
    assert (hybrid.sub_shard_numel, hybrid.shard_numel, hybrid.padded_numel) == (3, 9, 18)
    assert hybrid.sub_shard_piece(1, 1, 1) == LocalPiece(3, 5, 1, 3)  # param 1's rows 3..4 at shard 4..5
    assert hybrid.sub_shard_piece(0, 1, 2).numel == 0


def test_scalars_and_single_rows():
    layout = GroupLayout([(), (1,), (1, 5)], 3)
    assert [layout.owners_of_param(i) for i in range(3)] == [[0], [0], [0]]
    assert [c.chunk_numel for c in layout.chunks] == [1, 1, 5]  # a padded slot on every rank
    assert layout.local_shape(0, 1) == () and layout.local_shape(2, 2) == (0, 5)


def test_empty_group_still_has_one_element_per_rank():
    layout = GroupLayout([(0,)], 3)
    assert layout.shard_numel == 1 and layout.padded_numel == 3


def test_forms_coincide_only_without_rearrangement():
    assert GroupLayout(SHAPES, 1).forms_coincide
    assert GroupLayout([(7, 3)], 4).forms_coincide
    assert not GroupLayout([(7, 3)], 4, outer_size=5).forms_coincide  # a tail pad after the one parameter
    assert not GroupLayout([(7, 3), (2,)], 2).forms_coincide


def _unsharded_of(layout, values):
    unsharded = torch.zeros(layout.padded_numel, dtype=torch.float64)
    for span, value in zip(layout.spans, values):
        unsharded[span.flat_start:span.flat_end] = value.reshape(-1)
    return unsharded


@pytest.mark.parametrize("dp_size,outer_size", [(1, 1), (2, 1), (3, 1), (4, 1), (3, 2), (2, 3)])
def test_copy_out_and_copy_in_agree_with_the_rows(dp_size, outer_size):
    layout = GroupLayout(SHAPES, dp_size, outer_size)
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in SHAPES]
    unsharded = _unsharded_of(layout, values)
    shards = []
    for rank in range(dp_size):
        shard = torch.full((layout.shard_numel,), float("nan"), dtype=torch.float64)
        shard_of_unsharded(layout, unsharded, rank, shard)
        for index, value in enumerate(values):  # a shard holds the rank's rows where its pieces say
            piece = layout.local_piece(index, rank)
            rows = value.reshape(-1)[piece.param_start:piece.param_end]
            assert torch.equal(shard[piece.shard_start:piece.shard_end], rows)
        shards.append(shard)
    gathered = torch.cat(shards)
    assert not gathered.isnan().any()  # padding is copied (zeros), not left undefined
    out = torch.full_like(unsharded, float("nan"))
    copy_gathered_to_unsharded(layout, gathered, out)
    assert torch.equal(out, unsharded)
    # copy-in: full gradients written rank-major, scaled, with padding zeroed, then accumulated once more
    rank_major = torch.full_like(gathered, float("nan"))
    rank_major.view(dp_size, layout.shard_numel)[:, layout.used_shard_numel:] = 0
    for index, value in enumerate(values):
        copy_grad_in(layout, rank_major, index, value, 0.5, accumulate=False)
        copy_grad_in(layout, rank_major, index, value, 0.25, accumulate=True)
    torch.testing.assert_close(rank_major, 0.75 * gathered, rtol=0, atol=0)


@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_copy_in_lands_rows_rank_major_in_a_buffer_view_from_strided_gradients(dp_size):
    """Gradient buffers are views into larger storage and autograd may hand over a transposed gradient: each row
    of parameter `i` still lands in the shard of the rank that owns it, at the chunk's offset, written the first
    time and added the second."""
    shapes = [(4, 6), (6, 4), (5,), (3, 2)]
    layout = GroupLayout(shapes, dp_size)
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(shape[::-1], generator=generator, dtype=torch.float64).t() if len(shape) == 2
             else torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]
    assert not grads[0].is_contiguous()
    storage = torch.full((layout.padded_numel + 11,), float("nan"), dtype=torch.float64)
    buffer = storage[5:5 + layout.padded_numel]
    buffer.view(dp_size, layout.shard_numel)[:, layout.used_shard_numel:] = 0
    for index, grad in enumerate(grads):
        copy_grad_in(layout, buffer, index, grad, 0.5, accumulate=False)
        copy_grad_in(layout, buffer, index, grad, 2.0, accumulate=True)
    for index, (shape, grad) in enumerate(zip(shapes, grads)):
        chunk = layout.chunks[index]
        row_numel = math.prod(shape[1:])
        for rank in range(dp_size):
            start, end = chunk_rows(shape[0], dp_size, rank)
            shard = buffer[rank * layout.shard_numel:(rank + 1) * layout.shard_numel]
            written = shard[chunk.shard_offset:chunk.shard_offset + chunk.chunk_numel]
            expected = torch.zeros(chunk.chunk_numel, dtype=torch.float64)
            expected[:(end - start) * row_numel] = 2.5 * grad[start:end].reshape(-1)
            assert torch.equal(written, expected)
    assert storage[:5].isnan().all() and storage[5 + layout.padded_numel:].isnan().all()


def test_chunk_rows_matches_torch_chunk():
    for rows in [0, 1, 2, 5, 7, 13]:
        for world in [1, 2, 3, 4]:
            chunks = torch.arange(rows).chunk(world) if rows else []
            for rank in range(world):
                start, end = chunk_rows(rows, world, rank)
                expected = chunks[rank].tolist() if rank < len(chunks) else []
                assert list(range(start, end)) == expected


def test_bucket_by_size():
    assert bucket_by_size([4, 4, 4, 10, 1], 8) == [[0, 1], [2], [3], [4]]
    assert bucket_by_size([4, 4, 4], 0) == [[0, 1, 2]]

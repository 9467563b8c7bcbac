"""Flat-buffer arithmetic: every element of every parameter is owned by exactly one rank."""

import math

import pytest

from megatron_fsdp.layout import GroupLayout, LocalPiece, bucket_by_size, chunk_rows

SHAPES = [(13, 7), (13,), (0,), (2,), (7, 13), (1, 1, 3), ()]


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4, 5, 6])
def test_every_element_owned_once(dp_size):
    layout = GroupLayout(SHAPES, dp_size)
    total = sum(math.prod(s) for s in SHAPES)
    assert layout.numel == total
    assert layout.padded_numel % dp_size == 0 and layout.padded_numel - total < dp_size
    for index, shape in enumerate(SHAPES):
        owned = []
        for rank in range(dp_size):
            piece = layout.local_piece(index, rank)
            shard_start, _ = layout.shard_range(rank)
            assert 0 <= piece.shard_start <= piece.shard_end <= layout.shard_numel
            # the piece's shard position maps back to the same flat elements
            assert shard_start + piece.shard_start == layout.spans[index].flat_start + piece.param_start or (
                piece.numel == 0)
            owned.extend(range(piece.param_start, piece.param_end))
        assert owned == list(range(math.prod(shape)))


@pytest.mark.parametrize("dp_size,outer_size", [(1, 2), (2, 2), (3, 2), (2, 3), (4, 3), (5, 4)])
def test_every_element_owned_once_across_outer_and_shard_ranks(dp_size, outer_size):
    """HFSDP: each shard splits into equal sub-shards; every element has exactly one (shard, outer) owner."""
    layout = GroupLayout(SHAPES, dp_size, outer_size)
    total = sum(math.prod(s) for s in SHAPES)
    assert layout.numel == total
    assert layout.shard_numel == layout.sub_shard_numel * outer_size
    assert layout.padded_numel == layout.shard_numel * dp_size
    assert layout.padded_numel - total < dp_size * outer_size
    owners = [[] for _ in range(layout.padded_numel)]
    for rank in range(dp_size):
        shard_start, shard_end = layout.shard_range(rank)
        for outer_rank in range(outer_size):
            start, end = layout.sub_shard_range(rank, outer_rank)
            assert shard_start <= start < end <= shard_end
            assert start - shard_start == layout.sub_shard_offset(outer_rank)
            for flat in range(start, end):
                owners[flat].append((rank, outer_rank))
    assert all(len(owner) == 1 for owner in owners)
    for index, shape in enumerate(SHAPES):
        span = layout.spans[index]
        owned = []
        for rank in range(dp_size):
            shard_piece = layout.local_piece(index, rank)
            from_sub_shards = []
            for outer_rank in range(outer_size):
                piece = layout.sub_shard_piece(index, rank, outer_rank)
                assert piece == layout.sub_shard_pieces(rank, outer_rank)[index]
                assert 0 <= piece.shard_start <= piece.shard_end <= layout.sub_shard_numel
                if piece.numel:
                    start, _ = layout.sub_shard_range(rank, outer_rank)
                    assert start + piece.shard_start == span.flat_start + piece.param_start
                from_sub_shards.extend(range(piece.param_start, piece.param_end))
            # the sub-shard pieces of one shard rank tile that rank's shard piece, in outer-rank order
            assert from_sub_shards == list(range(shard_piece.param_start, shard_piece.param_end))
            owned.extend(from_sub_shards)
        assert owned == list(range(math.prod(shape)))


def test_outer_size_one_is_the_plain_layout():
    for dp_size in (1, 2, 3, 5):
        plain, hybrid = GroupLayout(SHAPES, dp_size), GroupLayout(SHAPES, dp_size, 1)
        assert (plain.shard_numel, plain.padded_numel) == (hybrid.shard_numel, hybrid.padded_numel)
        assert hybrid.sub_shard_numel == hybrid.shard_numel
        for rank in range(dp_size):
            assert hybrid.sub_shard_pieces(rank, 0) == plain.local_pieces(rank)


def test_sub_shard_padding_example():
    layout = GroupLayout([(3, 2), (5,)], 2, 3)  # 11 elements -> sub-shards of 2, shards of 6, padded to 12
    assert (layout.sub_shard_numel, layout.shard_numel, layout.padded_numel) == (2, 6, 12)
    assert layout.sub_shard_range(1, 2) == (10, 12)
    piece = layout.sub_shard_piece(1, 1, 0)  # flat [6, 8): elements 0..1 of param 1
    assert (piece.param_start, piece.param_end, piece.shard_start, piece.shard_end) == (0, 2, 0, 2)
    assert layout.sub_shard_piece(0, 1, 0).numel == 0


def test_spans_are_contiguous_and_ordered():
    layout = GroupLayout([(3, 2), (5,), (0,), (4,)], 4)
    assert [(s.flat_start, s.flat_end) for s in layout.spans] == [(0, 6), (6, 11), (11, 11), (11, 15)]
    assert layout.shard_numel == 4 and layout.padded_numel == 16
    # rank 1 owns flat [4, 8): the last two elements of param 0 at shard offset 0, rank 2 owns flat [8, 12):
    # the rest of param 1 and the first element of param 3; param 1 misses rank 0 entirely (an empty piece
    # clamped to the end of its shard)
    assert layout.local_piece(0, 1) == LocalPiece(4, 6, 0, 2)
    assert layout.local_piece(1, 2) == LocalPiece(2, 5, 0, 3)
    assert layout.local_piece(3, 2) == LocalPiece(0, 1, 3, 4)
    assert layout.local_piece(1, 0) == LocalPiece(0, 0, 4, 4)
    piece = layout.local_piece(1, 1)  # rank 1 owns flat [4, 8): elements 0..1 of param 1 at shard offset 2
    assert (piece.param_start, piece.param_end, piece.shard_start, piece.shard_end) == (0, 2, 2, 4)
    assert layout.owners_of_param(3) == [2, 3]


def test_empty_group_still_has_one_element_per_rank():
    layout = GroupLayout([(0,)], 3)
    assert layout.shard_numel == 1 and layout.padded_numel == 3


def test_chunk_rows_matches_torch_chunk():
    import torch

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

"""Flat ranges of a tensor as boxes, and pieces of a logical tensor through DCP on one process."""

import itertools
import math

import pytest
import torch

from megatron.core.dist_checkpointing.logical_tensor import (
    ShardedLogicalTensor,
    flat_range_boxes,
    flat_range_pieces,
)


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (1, 4, 1, 3)])
def test_flat_range_boxes_cover_exactly_the_range_with_contiguous_boxes(shape):
    total = math.prod(shape)
    flat_index = torch.arange(total).view(shape)
    for start, end in itertools.combinations(range(total + 1), 2):
        boxes = flat_range_boxes(shape, start, end)
        covered = []
        for box in boxes:
            region = flat_index[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))].reshape(-1)
            # contiguous in flat order, starting where the box says
            assert region.tolist() == list(range(box.flat_start, box.flat_start + region.numel()))
            covered += region.tolist()
        assert covered == list(range(start, end))
        assert len(boxes) <= 2 * len(shape) - 1


def test_flat_range_boxes_rejects_ranges_outside_the_tensor():
    with pytest.raises(ValueError, match=r"flat range \[3, 13\) is outside a tensor of 12 elements"):
        flat_range_boxes((3, 4), 3, 13)


def test_pieces_saved_by_flat_ranges_load_into_any_box(tmp_path):
    from megatron.core.dist_checkpointing import serialization

    full = torch.randn(6, 10)
    # Three "ranks" worth of flat shards of a TP partition (rows 2..5 of the logical tensor).
    partition = full[2:6]
    pieces = []
    for start, end in ((0, 13), (13, 27), (27, 40)):
        pieces += flat_range_pieces(partition.reshape(-1)[start:end].clone(), (4, 10), (2, 0), start, end)
    pieces.append(((0, 0), full[0:2].clone()))
    serialization.save({"w": ShardedLogicalTensor((6, 10), pieces)}, str(tmp_path))
    # Load a different decomposition: columns 3..9 of all rows, and the flat range [5, 50) of the whole.
    columns = torch.zeros(6, 7)
    flat = torch.zeros(45)
    serialization.load({"w": ShardedLogicalTensor((6, 10), [((0, 3), columns)])}, str(tmp_path))
    serialization.load({"w": ShardedLogicalTensor((6, 10), flat_range_pieces(flat, (6, 10), (0, 0), 5, 50))},
                       str(tmp_path))
    assert torch.equal(columns, full[:, 3:])
    assert torch.equal(flat, full.reshape(-1)[5:50])
    with pytest.raises(serialization.CheckpointShapeError, match=r"'w' has shape \(6, 10\) .* but \(6, 11\)"):
        serialization.check_shapes({"w": ShardedLogicalTensor((6, 11), [])}, serialization.read_metadata(
            str(tmp_path)), str(tmp_path))

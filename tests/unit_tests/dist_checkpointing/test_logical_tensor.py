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


def test_vocab_rows_load_across_another_padding_from_flat_ranges(tmp_path):
    """8 rows saved (a vocabulary of 6, padded) as flat shards; loaded by a model of 12 rows whose pieces are
    flat ranges too: rows 0-7 come from the checkpoint, the moments' other rows are zero, the weights' keep
    their values; and the other way round, 12 rows saved and 8 loaded."""
    from megatron.core.dist_checkpointing import serialization, vocab_padding

    def flat_pieces(flat, rows, bounds):
        pieces = []
        for start, end in bounds:
            pieces += flat_range_pieces(flat[start:end], (rows, 3), (0, 0), start, end)
        return pieces

    for saved_rows, model_rows in ((8, 12), (12, 8)):
        directory = str(tmp_path / f"{saved_rows}_to_{model_rows}")
        weights, moments = torch.randn(saved_rows, 3), torch.rand(saved_rows, 3) + 1
        serialization.save({key: ShardedLogicalTensor((saved_rows, 3), flat_pieces(
            value.reshape(-1).clone(), saved_rows, ((0, 7), (7, 3 * saved_rows)))) for key, value in (
            ("model.output_layer.weight", weights), ("optimizer.state.output_layer.weight.exp_avg", moments),
            ("model.decoder.final_layernorm.weight", weights))}, directory)
        new_weights, new_moments = torch.full((model_rows * 3,), 5.0), torch.full((model_rows * 3,), 5.0)
        end = 3 * model_rows
        bounds = ((0, 10), (10, end - 5), (end - 5, end))  # shards that start and end inside rows
        targets = {"model.output_layer.weight": ShardedLogicalTensor(
                       (model_rows, 3), flat_pieces(new_weights, model_rows, bounds)),
                   "optimizer.state.output_layer.weight.exp_avg": ShardedLogicalTensor(
                       (model_rows, 3), flat_pieces(new_moments, model_rows, bounds))}
        metadata = serialization.read_metadata(directory)
        changes = vocab_padding.adapt_targets(targets, serialization.tensor_shapes(metadata), vocab_size=6)
        assert [(c.name, c.saved_rows, c.model_rows) for c in changes] == [("output_layer.weight", saved_rows,
                                                                             model_rows)] * 2
        serialization.check_shapes(targets, metadata, directory)
        serialization.load(targets, directory)
        common = min(saved_rows, model_rows)
        loaded_weights, loaded_moments = new_weights.view(model_rows, 3), new_moments.view(model_rows, 3)
        assert torch.equal(loaded_weights[:common], weights[:common])
        assert torch.equal(loaded_moments[:common], moments[:common])
        assert torch.equal(loaded_weights[common:], torch.full((model_rows - common, 3), 5.0))
        assert torch.count_nonzero(loaded_moments[common:]) == 0
    # Fewer rows than tokens on one side, another trailing dim, or not a vocab tensor: still a shape error.
    metadata = serialization.read_metadata(directory)  # 12 rows saved
    for key, shape in (("model.output_layer.weight", (4, 3)), ("model.output_layer.weight", (8, 4)),
                       ("model.decoder.final_layernorm.weight", (8, 3))):
        targets = {key: ShardedLogicalTensor(shape, [])}
        assert vocab_padding.adapt_targets(targets, serialization.tensor_shapes(metadata), vocab_size=6) == []
        with pytest.raises(serialization.CheckpointShapeError, match=f"'{key}' has shape"):
            serialization.check_shapes(targets, metadata, directory)

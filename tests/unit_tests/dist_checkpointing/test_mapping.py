"""Upstream's sharded-state-dict classes: ShardedTensor with a flattened range, ShardedTensorFactory with
apply_factories, LocalNonpersistentObject; round trips through save / load at one process."""

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
)

FULL = torch.arange(12.0).view(3, 4)


def test_flattened_range_round_trip(tmp_path):
    flat = FULL.reshape(-1)
    lower = ShardedTensor.from_rank_offsets_flat("w", flat[2:7], (3, 4), (0, 1, 2), flattened_range=slice(2, 7))
    assert lower.flattened_range == slice(2, 7) and lower.local_shape == (3, 4)
    assert tuple(lower.global_shape) == (6, 4) and lower.global_offset == (3, 0)
    assert [(tuple(offsets), tuple(piece.shape)) for offsets, piece in lower.pieces] == [
        ((3, 2), (1, 2)), ((4, 0), (1, 3))]  # elements 2..6 of rows 3..5: the end of row 3, most of row 4
    whole = ShardedTensor.from_rank_offsets_flat("w", flat.clone(), (3, 4), flattened_range=slice(0, 12))
    dist_checkpointing.save({"w": whole}, tmp_path / "ckpt")
    target = torch.zeros(6)
    loaded = dist_checkpointing.load(
        {"w": ShardedTensor("w", target, torch.float32, (3, 4), (3, 4), (0, 0), flattened_range=slice(3, 9))},
        tmp_path / "ckpt", strict="raise_all")
    assert torch.equal(target, flat[3:9]) and torch.equal(loaded["w"], flat[3:9])


def test_flattened_range_is_checked():
    with pytest.raises(ValueError, match="from_rank_offsets_flat"):
        ShardedTensor.from_rank_offsets("w", torch.zeros(5), flattened_range=slice(0, 5))
    with pytest.raises(ValueError, match="ShardedTensor 'w': with flattened_range"):
        ShardedTensor.from_rank_offsets_flat("w", torch.zeros(5), (3, 4), flattened_range=slice(10, 15))


def _split_rows(key, data, replica_id, flattened_range):
    return {"top": ShardedTensor.from_rank_offsets(f"{key}.top", data[:1], replica_id=replica_id),
            "bottom": ShardedTensor.from_rank_offsets(f"{key}.bottom", data[1:], replica_id=replica_id)}


def _join_rows(loaded):
    return torch.cat([loaded["top"], loaded["bottom"]])


def _with_factory(data, local_value):
    return {"model": {"fused": ShardedTensorFactory("fused", data, _split_rows, _join_rows),
                      "seed": LocalNonpersistentObject(local_value)}, "iteration": 3}


def test_factory_and_local_object_round_trip(tmp_path):
    state = _with_factory(FULL.clone(), "saved run")
    dist_checkpointing.save(state, tmp_path / "ckpt")
    assert isinstance(state["model"]["fused"]["top"], ShardedTensor)  # built in place, as upstream
    assert sorted(dist_checkpointing.load_tensors_metadata(tmp_path / "ckpt")) == ["fused.bottom", "fused.top"]
    assert "seed" not in str(dist_checkpointing.load_common_state_dict(tmp_path / "ckpt"))
    loaded = dist_checkpointing.load(_with_factory(torch.zeros(3, 4), "this run"), tmp_path / "ckpt",
                                     strict="raise_all")
    assert torch.equal(loaded["model"]["fused"], FULL)
    assert loaded["model"]["seed"] == "this run" and loaded["iteration"] == 3


def test_apply_factories_builds_in_place():
    state = {"a": [ShardedTensorFactory("f", FULL, _split_rows, _join_rows)]}
    apply_factories(state)
    assert torch.equal(state["a"][0]["bottom"].data, FULL[1:]) and state["a"][0]["top"].key == "f.top"


def test_sharded_object_unique_key_is_an_attribute():
    extra = dist_checkpointing.ShardedObject("layer._extra_state", {"a": 1}, (2, 4), (1, 3))
    assert extra.unique_key == "layer._extra_state/shard_1.3_2.4"

"""Upstream's reads of a torch_dist checkpoint without a model (check_is_distributed_checkpoint,
load_tensors_metadata, load_sharded_metadata, load_plain_tensors, load_content_metadata), remove_sharded_tensors,
and their errors for directories that are
not one; upstream's ShardedTensor / ShardedObject saved and loaded by `save` / `load` at two ranks."""

import os

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.errors import CheckpointError
from tests.unit_tests.dist_checkpointing.test_upstream_api import _nested, _saved
from tests.unit_tests.multiprocess_harness import run_on_ranks


def test_reads_of_a_saved_checkpoint(tmp_path):
    weight = _saved(tmp_path)
    directory = tmp_path / "ckpt"
    assert dist_checkpointing.check_is_distributed_checkpoint(directory)
    assert not dist_checkpointing.check_is_distributed_checkpoint(tmp_path)
    (key, described), = dist_checkpointing.load_tensors_metadata(directory).items()
    assert key == described.key == "model.w" and described.data is None
    assert tuple(described.global_shape) == (3, 4) and described.dtype == torch.float32
    plain = dist_checkpointing.load_plain_tensors(directory)
    assert set(plain) == {"model.w"} and torch.equal(plain["model.w"], weight)  # objects are not tensors
    assert dist_checkpointing.load_content_metadata(directory) is None


def test_content_metadata_and_nested_tensors(tmp_path):
    weight, bias = torch.arange(6.0).view(2, 3), torch.tensor([7.0, 8.0], dtype=torch.bfloat16)
    content = {"distrib_optim_sharding_type": "fully_sharded_model_space"}
    dist_checkpointing.save(_nested(weight, bias), tmp_path / "ckpt", content_metadata=content)
    assert dist_checkpointing.load_content_metadata(tmp_path / "ckpt") == content
    common = dist_checkpointing.load_common_state_dict(tmp_path / "ckpt")
    assert dist_checkpointing.load_content_metadata(preloaded_state_dict=common) == content
    described = dist_checkpointing.load_tensors_metadata(tmp_path / "ckpt")
    assert {key: (tuple(each.global_shape), each.dtype) for key, each in described.items()} == {
        "decoder.w": ((2, 3), torch.float32), "exp_avg.0": ((2,), torch.bfloat16)}
    plain = dist_checkpointing.load_plain_tensors(tmp_path / "ckpt")
    assert torch.equal(plain["decoder.w"], weight) and torch.equal(plain["exp_avg.0"], bias)


def _with_object_and_two_tensors(directory):
    ShardedTensor = dist_checkpointing.ShardedTensor
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("decoder.w", torch.ones(2, 3)),
                             "b": ShardedTensor.from_rank_offsets("decoder.b", torch.ones(3, dtype=torch.bfloat16)),
                             "extra": dist_checkpointing.ShardedObject("decoder._extra", {"x": 1}, (2, 1), (1, 0)),
                             "iteration": 4}, directory)


def test_load_sharded_metadata_describes_tensors_and_objects(tmp_path):
    _with_object_and_two_tensors(tmp_path)
    described = dist_checkpointing.load_sharded_metadata(tmp_path)
    assert sorted(described) == ["decoder._extra/shard_1.0_2.1", "decoder.b", "decoder.w"]
    extra = described["decoder._extra/shard_1.0_2.1"]
    assert isinstance(extra, dist_checkpointing.ShardedObject) and extra.data is None
    assert (extra.key, extra.global_shape, extra.global_offset) == ("decoder._extra", (2, 1), (1, 0))
    assert tuple(described["decoder.b"].global_shape) == (3,) and described["decoder.b"].dtype == torch.bfloat16


def test_remove_sharded_tensors_drops_them_from_the_checkpoint(tmp_path):
    _with_object_and_two_tensors(tmp_path)
    dist_checkpointing.remove_sharded_tensors(tmp_path, "decoder.b")
    assert sorted(dist_checkpointing.load_tensors_metadata(tmp_path)) == ["decoder.w"]
    assert torch.equal(dist_checkpointing.load_plain_tensors(tmp_path)["decoder.w"], torch.ones(2, 3))
    assert dist_checkpointing.load_common_state_dict(tmp_path) == {"iteration": 4,
                                                                  "decoder._extra/shard_1.0_2.1": {"x": 1}}
    target = torch.zeros(3, dtype=torch.bfloat16)
    loaded = dist_checkpointing.load({"b": dist_checkpointing.ShardedTensor.from_rank_offsets("decoder.b", target)},
                                     tmp_path, strict="return_unexpected")
    assert loaded[2] == {"decoder.b"} and torch.equal(target, torch.zeros(3, dtype=torch.bfloat16))


def _root_with_tracker(path):
    os.makedirs(path / "iter_0000004")
    (path / "latest_checkpointed_iteration.txt").write_text("4")
    return "it is a checkpoint root .*iterations there: 4.*iter_0000004"


def _torch_format(path):
    os.makedirs(path / "mp_rank_00")
    return "it holds a --ckpt-format torch checkpoint \\(mp_rank_00\\).*convert_legacy.py"


def _other_files(path):
    os.makedirs(path)
    (path / "notes.txt").write_text("x")
    return "it holds notes.txt \\(1 entries\\)"


@pytest.mark.parametrize("make", [_root_with_tracker, _torch_format, _other_files,
                                  lambda path: "it does not exist", lambda path: os.makedirs(path) or "it is empty"])
@pytest.mark.parametrize("read", ["load_tensors_metadata", "load_plain_tensors", "load_content_metadata"])
def test_a_directory_that_is_not_a_checkpoint_is_named_with_what_it_holds(tmp_path, make, read):
    directory = tmp_path / "ckpt"
    holds = make(directory)
    with pytest.raises(CheckpointError, match=f"{directory} is not a torch_dist checkpoint .*: {holds}"):
        getattr(dist_checkpointing, read)(directory)
    assert not dist_checkpointing.check_is_distributed_checkpoint(directory)


FULL_WEIGHT = torch.arange(24.0).view(4, 6)
LAYERS = torch.arange(6.0).view(2, 3) + 100


def _upstream_style_state(rank, weight, layer, bias, loading=False):
    """A module's sharded_state_dict as upstream writes one: a TP-split weight, per-layer tensors stacked on a
    prepended axis, a replicated bias (one replica per rank) and a per-rank object."""
    ShardedTensor, ShardedObject = dist_checkpointing.ShardedTensor, dist_checkpointing.ShardedObject
    axis = 1 if loading else 0  # loaded split by columns where it was saved split by rows
    return {"weight": ShardedTensor.from_rank_offsets("layer.weight", weight, (axis, rank, 2)),
            "stacked": ShardedTensor.from_rank_offsets("layers.w", layer, (0, rank, 2), prepend_axis_num=1),
            "bias": ShardedTensor.from_rank_offsets("layer.bias", bias, replica_id=rank),
            "extra": ShardedObject("layer._extra_state", None if loading else {"rank": rank}, (2,), (rank,)),
            "iteration": None if loading else 7}


def _save_split_then_load_split_otherwise(directory):
    rank = torch.distributed.get_rank()
    saved = _upstream_style_state(rank, FULL_WEIGHT[2 * rank:2 * rank + 2].clone(), LAYERS[rank].clone(),
                                  torch.tensor([1.0, 2.0]))
    dist_checkpointing.save(saved, directory)
    weight, layer, bias = torch.zeros(4, 3), torch.zeros(3), torch.zeros(2)
    loaded = dist_checkpointing.load(_upstream_style_state(rank, weight, layer, bias, loading=True), directory,
                                     strict="raise_all")
    plain = dist_checkpointing.load_plain_tensors(directory)
    filled_in_place = loaded["weight"].data_ptr() == weight.data_ptr()
    return weight, layer, bias, filled_in_place, loaded["extra"], loaded["iteration"], plain


def test_sharded_tensor_and_object_round_trip_at_two_ranks(tmp_path):
    results = run_on_ranks(2, _save_split_then_load_split_otherwise, str(tmp_path / "ckpt"))
    for rank, (weight, layer, bias, filled_in_place, extra, iteration, plain) in enumerate(results):
        assert torch.equal(weight, FULL_WEIGHT[:, 3 * rank:3 * rank + 3]) and filled_in_place
        assert torch.equal(layer, LAYERS[rank]) and torch.equal(bias, torch.tensor([1.0, 2.0]))
        assert extra == {"rank": rank} and iteration == 7
        assert set(plain) == {"layer.weight", "layers.w", "layer.bias"}
        assert torch.equal(plain["layer.weight"], FULL_WEIGHT) and torch.equal(plain["layers.w"], LAYERS)


def test_from_rank_offsets_describes_upstream_placements():
    local = torch.ones(2, 3)
    sharded = dist_checkpointing.ShardedTensor.from_rank_offsets("w", local, (1, 1, 4), prepend_axis_num=1)
    assert (tuple(sharded.global_shape), sharded.global_offset, sharded.axis_fragmentations) == (
        (1, 8, 3), (0, 2, 0), (1, 4, 1))
    assert sharded.local_shape == (2, 3) and sharded.data is local
    with pytest.raises(ValueError, match="ShardedTensor 'w': invalid rank offset \\(0, 2, 2\\)"):
        dist_checkpointing.ShardedTensor.from_rank_offsets("w", local, (0, 2, 2))

"""Upstream's dist_checkpointing entry points over the torch_dist format (one process): save / load /
load_common_state_dict round trips, strictness for missing keys, replace_prefix_for_sharding, the strategy
classes and parse_strict_flag."""

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from megatron.core.dist_checkpointing.strictness import CheckpointKeyError
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.dist_checkpointing.validation import StrictHandling, parse_strict_flag


def _saved(tmp_path):
    weight = torch.arange(12.0).view(3, 4)
    state = {"model.w": ShardedLogicalTensor.from_local(weight), "modelopt_version": "0.47.0",
             "modelopt_state_dict": [("quantize", {"metadata": {}})]}
    dist_checkpointing.save(state, tmp_path / "ckpt", ("torch_dist", 1))
    return weight


def test_save_then_load_and_common_state(tmp_path):
    weight = _saved(tmp_path)
    target = torch.zeros(3, 4)
    loaded = dist_checkpointing.load({"model.w": ShardedLogicalTensor.from_local(target)}, tmp_path / "ckpt",
                                     TorchDistLoadShardedStrategy())
    assert torch.equal(target, weight) and set(loaded) == {"model.w"}
    assert dist_checkpointing.load_common_state_dict(tmp_path / "ckpt") == {
        "modelopt_version": "0.47.0", "modelopt_state_dict": [("quantize", {"metadata": {}})]}


def test_missing_keys_follow_strictness(tmp_path):
    _saved(tmp_path)
    wanted = {"model.absent": ShardedLogicalTensor.from_local(torch.zeros(2))}
    with pytest.raises(CheckpointKeyError, match="model.absent"):
        dist_checkpointing.load(dict(wanted), tmp_path / "ckpt", strict=StrictHandling.RAISE_ALL)
    assert dist_checkpointing.load(dict(wanted), tmp_path / "ckpt", strict="log_all") == {}


def test_replace_prefix_for_sharding():
    state = {"decoder.a": 1, "decoder.b": {"decoder.c": 2}}
    replace_prefix_for_sharding(state, "decoder.", "model.decoder.")
    assert state == {"model.decoder.a": 1, "model.decoder.b": {"model.decoder.c": 2}}
    with pytest.raises(ValueError, match="'other' does not start"):
        replace_prefix_for_sharding({"other": 1}, "decoder.", "x.")


def test_parse_strict_flag(tmp_path):
    assert parse_strict_flag(True) is StrictHandling.RAISE_ALL
    assert parse_strict_flag("log_unexpected") is StrictHandling.LOG_UNEXPECTED
    with pytest.raises(ValueError, match="--dist-ckpt-strictness"):
        parse_strict_flag("sometimes")
    with pytest.raises(ValueError, match="torch_dist"):
        dist_checkpointing.save({}, str(tmp_path / "zarr_checkpoint"), ("zarr", 1))
    assert not (tmp_path / "zarr_checkpoint").exists()  # refused before anything was written


def test_load_returns_tensors_that_load_state_dict_takes(tmp_path):
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    class Tiny(MegatronModule):
        def __init__(self):
            super().__init__(TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1))
            self.linear = torch.nn.Linear(4, 3)

    saved, target = Tiny(), Tiny()
    with torch.no_grad():
        target.linear.weight.zero_()
    assert set(saved.sharded_state_dict(prefix="")) == {"linear.weight", "linear.bias"}
    dist_checkpointing.save(sharded_state_dict=saved.sharded_state_dict(prefix=""), checkpoint_dir=tmp_path / "c")
    loaded = dist_checkpointing.load(sharded_state_dict=target.sharded_state_dict(prefix=""),
                                     checkpoint_dir=tmp_path / "c")
    assert all(type(value) is torch.Tensor for value in loaded.values())
    target.load_state_dict(loaded)
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), target.state_dict().values()))


def _nested(weight, bias):
    return {"model": {"decoder.w": ShardedLogicalTensor.from_local(weight)},
            "optimizer": {"state": {"exp_avg": [ShardedLogicalTensor.from_local(bias)]}, "param_groups": [{"lr": 2}]},
            "iteration": 3, "args": {"seq_length": 8}}


def test_nested_state_dict_round_trip(tmp_path):
    weight, bias = torch.arange(6.0).view(2, 3), torch.tensor([7.0, 8.0])
    dist_checkpointing.save(_nested(weight, bias), tmp_path / "ckpt")
    weight_target, bias_target = torch.zeros(2, 3), torch.zeros(2)
    request = _nested(weight_target, bias_target)
    request["iteration"] = None
    loaded = dist_checkpointing.load(request, tmp_path / "ckpt", strict="raise_all")
    assert torch.equal(weight_target, weight) and torch.equal(bias_target, bias)
    assert torch.equal(loaded["model"]["decoder.w"], weight)
    assert torch.equal(loaded["optimizer"]["state"]["exp_avg"][0], bias)
    assert loaded["optimizer"]["param_groups"] == [{"lr": 2}] and loaded["iteration"] == 3
    assert loaded["args"] == {"seq_length": 8}
    common = dist_checkpointing.load_common_state_dict(tmp_path / "ckpt")
    assert common == {"model": {}, "optimizer": {"state": {"exp_avg": [None]}, "param_groups": [{"lr": 2}]},
                      "iteration": 3, "args": {"seq_length": 8}}


def test_nested_keys_follow_strictness(tmp_path):
    dist_checkpointing.save(_nested(torch.ones(2, 3), torch.ones(2)), tmp_path / "ckpt")
    request = {"model": {"decoder.absent": ShardedLogicalTensor.from_local(torch.zeros(2))}, "iteration": None}
    with pytest.raises(CheckpointKeyError, match=r"not in the checkpoint: decoder.absent;.* not in the model: "
                                                 r"decoder.w, exp_avg.0"):
        dist_checkpointing.load(request, tmp_path / "ckpt", strict="raise_all")
    with pytest.raises(CheckpointKeyError, match="decoder.absent"):
        dist_checkpointing.load(request, tmp_path / "ckpt")
    loaded, missing, unexpected = dist_checkpointing.load(request, tmp_path / "ckpt", strict="return_all")
    assert loaded == {"model": {}, "iteration": 3}
    # Upstream's names: missing = in the checkpoint, asked for by no one; unexpected = asked for, not saved.
    assert missing == {"decoder.w", "exp_avg.0"} and unexpected == {"decoder.absent"}
    with pytest.raises(CheckpointKeyError, match="epoch"):
        dist_checkpointing.load({"epoch": None}, tmp_path / "ckpt")


def test_one_key_for_two_nested_entries_is_refused(tmp_path):
    entry = {"w": ShardedLogicalTensor.from_local(torch.zeros(2))}
    with pytest.raises(ValueError, match="'model0.w' and 'model1.w' are both saved under the key 'w'"):
        dist_checkpointing.save({"model0": entry, "model1": {"w": ShardedLogicalTensor.from_local(torch.ones(2))}},
                                tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()

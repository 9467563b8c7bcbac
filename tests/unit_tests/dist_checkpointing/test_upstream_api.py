"""Upstream's dist_checkpointing entry points over the torch_dist format: save / load / load_common_state_dict
round trips, strictness for missing keys, replace_prefix_for_sharding, the strategy classes and parse_strict_flag,
upstream's save arguments, allow_shape_mismatch, a directory that is no checkpoint, and upstream ShardedTensors
saved at two ranks and loaded at one and three."""

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.errors import CheckpointError, CheckpointShapeError
from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from megatron.core.dist_checkpointing.strictness import CheckpointKeyError
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.dist_checkpointing.validation import StrictHandling, parse_strict_flag
from tests.unit_tests.multiprocess_harness import run_on_ranks


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


def test_save_takes_upstreams_arguments(tmp_path):
    weight = torch.arange(4.0)
    state = {"w": dist_checkpointing.ShardedTensor.from_rank_offsets("w", weight), "step": 2}
    dist_checkpointing.save(state, tmp_path / "ckpt", None, None, True, False, None)
    dist_checkpointing.save(state, tmp_path / "ckpt", preprocess_common_before_consistancy_check=lambda sd: sd)
    assert dist_checkpointing.load_common_state_dict(tmp_path / "ckpt") == {"step": 2}
    with pytest.raises(ValueError, match="async_sharded_save=True.*--async-save"):
        dist_checkpointing.save(state, tmp_path / "other", async_sharded_save=True)


def test_allow_shape_mismatch_reads_the_overlap(tmp_path):
    ShardedTensor = dist_checkpointing.ShardedTensor
    dist_checkpointing.save({"emb": ShardedTensor.from_rank_offsets("emb", torch.arange(6.0).view(3, 2))}, tmp_path)
    padded = torch.full((4, 2), -1.0)  # one padding row more than saved: left as it is
    dist_checkpointing.load({"emb": ShardedTensor.from_rank_offsets("emb", padded, allow_shape_mismatch=True)},
                            tmp_path)
    assert torch.equal(padded, torch.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [-1.0, -1.0]]))
    fewer = torch.zeros(2, 2)
    loaded = dist_checkpointing.load(
        {"emb": ShardedTensor.from_rank_offsets("emb", fewer, allow_shape_mismatch=True)}, tmp_path)
    assert torch.equal(loaded["emb"], torch.arange(4.0).view(2, 2)) and loaded["emb"].data_ptr() == fewer.data_ptr()
    with pytest.raises(CheckpointShapeError, match=r"tensor 'emb' has shape \(3, 2\) in the checkpoint but \(4, 2\)"):
        dist_checkpointing.load({"emb": ShardedTensor.from_rank_offsets("emb", torch.zeros(4, 2))}, tmp_path)


def test_load_from_a_directory_that_is_not_a_checkpoint_names_it(tmp_path):
    (tmp_path / "mp_rank_00").mkdir()
    request = {"w": dist_checkpointing.ShardedTensor.from_rank_offsets("w", torch.zeros(2))}
    with pytest.raises(CheckpointError, match="is not a torch_dist checkpoint.*--ckpt-format torch checkpoint"):
        dist_checkpointing.load(request, tmp_path)
    assert not dist_checkpointing.check_is_distributed_checkpoint(tmp_path)


def _save_at_two(directory):
    rank = torch.distributed.get_rank()
    ShardedTensor = dist_checkpointing.ShardedTensor
    rows = torch.arange(12.0).view(6, 2)[3 * rank:3 * rank + 3].clone()
    flat = torch.arange(10.0)[5 * rank:5 * rank + 5].clone()
    dist_checkpointing.save({"model": {
        "w": ShardedTensor.from_rank_offsets("w", rows, (0, rank, 2)),
        "b": ShardedTensor.from_rank_offsets_flat("b", flat, (10,), flattened_range=slice(5 * rank, 5 * rank + 5)),
        "bias": ShardedTensor.from_rank_offsets("bias", torch.ones(2) * 7, replica_id=rank),
        "extra": dist_checkpointing.ShardedObject("extra", {"rank": rank}, (2,), (rank,))}, "iteration": 9},
        directory)


def _read_common_on_one_rank(directory):
    rank = torch.distributed.get_rank()
    common = dist_checkpointing.load_common_state_dict(directory) if rank == 1 else None  # one rank alone
    torch.distributed.barrier()
    return common


def test_one_rank_reads_the_common_state_alone(tmp_path):
    dist_checkpointing.save({"w": dist_checkpointing.ShardedTensor.from_rank_offsets("w", torch.ones(2)),
                             "iteration": 9}, tmp_path)
    assert run_on_ranks(2, _read_common_on_one_rank, str(tmp_path), timeout_s=30)[1] == {"iteration": 9}


def _request(rank, world_size):
    ShardedTensor = dist_checkpointing.ShardedTensor
    rows, per = 6 // world_size, -(-10 // world_size)
    start, stop = min(rank * per, 10), min((rank + 1) * per, 10)
    return {"model": {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(rows, 2), (0, rank, world_size)),
                      "b": ShardedTensor.from_rank_offsets_flat("b", torch.zeros(stop - start), (10,),
                                                                flattened_range=slice(start, stop)),
                      "bias": ShardedTensor.from_rank_offsets("bias", torch.zeros(2), replica_id=rank)},
            "iteration": None}


def _load_at(directory):
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return dist_checkpointing.load(_request(rank, world_size), directory, strict="raise_unexpected")


def test_saved_at_two_ranks_loads_at_one_and_three(tmp_path):
    directory = str(tmp_path / "ckpt")
    run_on_ranks(2, _save_at_two, directory)
    assert dist_checkpointing.load_common_state_dict(directory) == {
        "iteration": 9, "model": {}, "extra/shard_1_2": {"rank": 1}, "extra/shard_0_2": {"rank": 0}}
    alone = dist_checkpointing.load(_request(0, 1), directory, strict="raise_all")
    assert torch.equal(alone["model"]["w"], torch.arange(12.0).view(6, 2))
    assert torch.equal(alone["model"]["b"], torch.arange(10.0)) and alone["iteration"] == 9
    for rank, loaded in enumerate(run_on_ranks(3, _load_at, directory)):
        assert torch.equal(loaded["model"]["w"], torch.arange(12.0).view(6, 2)[2 * rank:2 * rank + 2])
        assert torch.equal(loaded["model"]["b"], torch.arange(10.0)[4 * rank:min(4 * rank + 4, 10)])
        assert torch.equal(loaded["model"]["bias"], torch.ones(2) * 7) and loaded["iteration"] == 9

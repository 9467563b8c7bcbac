"""Upstream's entry points `save`, `load` and `load_common_state_dict` over the torch_dist format.

`save` writes a sharded state dict (see `mapping`) into a directory, each rank its pieces and the picklable
objects once; `load` fills a sharded state dict in place from a checkpoint written at any layout and returns
it with each single-piece tensor as a plain tensor (so `model.load_state_dict(load(...))` works, as
upstream); `load_common_state_dict` returns every object the checkpoint holds (the state all ranks share).
"""

import os

from megatron.core.dist_checkpointing import serialization
from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy
from megatron.core.dist_checkpointing.strictness import KeyMismatch, apply_strictness
from megatron.core.dist_checkpointing.validation import StrictHandling, parse_strict_flag


def _save_strategy(sharded_strategy):
    if sharded_strategy is None:
        return TorchDistSaveShardedStrategy()
    if isinstance(sharded_strategy, tuple):  # (backend, version), as upstream accepts
        return TorchDistSaveShardedStrategy(*sharded_strategy)
    return sharded_strategy


def save(sharded_state_dict, checkpoint_dir, sharded_strategy=None, common_strategy=None,
         validate_access_integrity=True):
    """Write `sharded_state_dict` into `checkpoint_dir` (collective over the world)."""
    if common_strategy is not None:
        raise ValueError("a separate common-state strategy is not used: common objects are saved as objects")
    strategy = _save_strategy(sharded_strategy)  # refuses an unknown format before anything is written
    os.makedirs(str(checkpoint_dir), exist_ok=True)
    strategy.save(sharded_state_dict, checkpoint_dir)


def load(sharded_state_dict, checkpoint_dir, sharded_strategy=None, common_strategy=None,
         validate_access_integrity=True, strict=StrictHandling.ASSUME_OK_UNEXPECTED):
    """Fill `sharded_state_dict` in place from `checkpoint_dir` and return it. Keys the checkpoint lacks are
    handled by `strict` (a `StrictHandling`, its value, or a bool); keys the checkpoint has that are not asked
    for are never read."""
    if common_strategy is not None:
        raise ValueError("a separate common-state strategy is not used: common objects are saved as objects")
    strategy = sharded_strategy if sharded_strategy is not None else TorchDistLoadShardedStrategy()
    metadata = serialization.read_metadata(str(checkpoint_dir))
    saved = set(metadata.state_dict_metadata)
    mismatch = KeyMismatch(sorted(set(sharded_state_dict) - saved), [])
    remaining = apply_strictness(parse_strict_flag(strict), mismatch, str(checkpoint_dir))
    for key in remaining.missing:
        sharded_state_dict.pop(key, None)
    loaded = strategy.load(sharded_state_dict, checkpoint_dir)
    return {key: _local_tensor(value) for key, value in loaded.items()}


def _local_tensor(value):
    """A `ShardedLogicalTensor` of one piece as that piece (the rank's tensor, as upstream's load returns it, so
    `module.load_state_dict` takes the result); several pieces (flat distributed-optimizer ranges) stay as they
    are, filled in place."""
    if isinstance(value, ShardedLogicalTensor) and len(value.pieces) == 1:
        return value.pieces[0][1].detach()
    return value


def load_common_state_dict(checkpoint_dir):
    """Every picklable object saved in `checkpoint_dir`, by key."""
    metadata = serialization.read_metadata(str(checkpoint_dir))
    return serialization.read_objects(str(checkpoint_dir), serialization.object_keys(metadata), metadata=metadata)

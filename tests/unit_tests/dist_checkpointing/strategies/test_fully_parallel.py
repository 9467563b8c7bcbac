"""Upstream's strategy objects: `get_default_save_sharded_strategy` / `get_default_load_sharded_strategy` and the
fully-parallel wrappers around them, passed to save / load as upstream scripts do."""

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)


def test_wrapped_default_strategies_round_trip(tmp_path):
    weight = torch.arange(6.0).view(2, 3)
    save_strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"), None, True)
    dist_checkpointing.save({"w": dist_checkpointing.ShardedTensor.from_rank_offsets("w", weight)}, tmp_path,
                            save_strategy)
    target = torch.zeros(2, 3)
    load_strategy = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(tmp_path))
    dist_checkpointing.load({"w": dist_checkpointing.ShardedTensor.from_rank_offsets("w", target)}, tmp_path,
                            load_strategy)
    assert torch.equal(target, weight)


def test_unknown_format_is_named():
    with pytest.raises(ValueError, match="'zarr' is not supported.*torch_dist"):
        get_default_save_sharded_strategy("zarr")

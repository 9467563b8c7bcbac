"""megatron.core.utils: upstream's helpers over process groups, model configs and sharded checkpoint tensors."""

import types

import pytest
import torch

from megatron.core import utils
from megatron.core.dist_checkpointing import logical_names
from megatron.core.dist_checkpointing.logical_names import TensorParallelRank


def test_group_rank_and_size_without_a_group():
    assert utils.get_pg_size(None) == 1 and utils.get_pg_rank(None) == 0


def test_tensor_parallel_group_if_none():
    sentinel = object()
    assert utils.get_tensor_model_parallel_group_if_none(sentinel) is sentinel
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        utils.get_tensor_model_parallel_group_if_none(None)
    assert utils.get_tensor_model_parallel_group_if_none(None, check_initialized=False) is None


def test_model_config_is_found_through_wrappers():
    config = types.SimpleNamespace(hidden_size=8)
    inner = torch.nn.Module()
    inner.config = config
    wrapper = torch.nn.Module()
    wrapper.module = inner
    assert utils.get_model_config(wrapper) is config


def test_tp_sharded_tensor_is_this_ranks_partition(monkeypatch):
    monkeypatch.setattr(logical_names, "current_tensor_parallel_rank", lambda: TensorParallelRank(1, 2))
    local = torch.arange(6.0).view(2, 3)
    rows = utils.make_tp_sharded_tensor_for_checkpoint(local, "w", tp_axis=0)
    assert tuple(rows.global_shape) == (4, 3) and rows.piece_at((2, 0)) is local
    columns = utils.make_tp_sharded_tensor_for_checkpoint(local, "w", tp_axis=1)
    assert tuple(columns.global_shape) == (2, 6) and columns.piece_at((0, 3)) is local
    whole = utils.make_sharded_tensor_for_checkpoint(local, "b")
    assert tuple(whole.global_shape) == (2, 3) and whole.piece_at((0, 0)) is local
    with pytest.raises(NotImplementedError, match="prepended"):
        utils.make_tp_sharded_tensor_for_checkpoint(local, "w", prepend_offsets=((0, 1, 2),))
    with pytest.raises(ValueError, match="0-dimensional"):
        utils.make_tp_sharded_tensor_for_checkpoint(torch.tensor(1.0), "s")

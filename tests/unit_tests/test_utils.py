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


def _wrapped_gpt_like():
    inner = torch.nn.Linear(2, 2)
    inner.config = types.SimpleNamespace(hidden_size=2)
    inner.model_type = "encoder_or_decoder"
    inner.set_input_tensor = lambda tensor: None
    outer = torch.nn.Module()
    outer.module = inner
    outer.model_type = None  # a wrapper attribute that is None: skipped with allow_none=False
    return outer, inner


def test_get_attr_wrapped_model_walks_module_wrappers():
    outer, inner = _wrapped_gpt_like()
    assert utils.get_attr_wrapped_model(outer, "set_input_tensor") is inner.set_input_tensor
    assert utils.get_attr_wrapped_model(outer, "model_type") is None  # allow_none=True: the wrapper's own
    assert utils.get_attr_wrapped_model(outer, "model_type", allow_none=False) == "encoder_or_decoder"
    assert utils.get_attr_wrapped_model(outer, "config", return_model_obj=True) is inner
    with pytest.raises(RuntimeError, match="no attribute 'absent'"):
        utils.get_attr_wrapped_model(outer, "absent")
    with pytest.raises(RuntimeError, match=r"model\[i\]"):
        utils.get_attr_wrapped_model([outer], "config")


def test_unwrap_model_strips_float16_and_given_wrappers():
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.transformer.module import Float16Module

    inner = torch.nn.Linear(2, 2)
    half = Float16Module(ModelParallelConfig(bf16=True, params_dtype=torch.bfloat16), inner)
    assert utils.unwrap_model(half) is inner
    assert utils.unwrap_model([half, inner]) == [inner, inner]

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    outer = Wrapper(Wrapper(inner))
    assert utils.unwrap_model(outer) is outer  # not a known wrapper
    assert utils.unwrap_model(outer, module_instances=(Wrapper,)) is inner
    assert utils.unwrap_model(Wrapper(half), module_instances=(Wrapper,)) is half  # only the given classes


def test_upstream_helper_names():
    assert utils.divide(12, 4) == 3
    with pytest.raises(ValueError, match="not divisible"):
        utils.divide(5, 2)
    assert utils.init_method_normal(0.02).std == 0.02
    assert utils.scaled_init_method_normal(0.02, 8).std == pytest.approx(0.02 / 4.0)
    assert utils.scaled_init_method_normal(0.02, 8, multiplier=0.5).std == pytest.approx(0.01)
    batch = {"tokens": torch.arange(4).view(1, 4)}
    assert utils.get_batch_on_this_cp_rank(batch) is batch  # no context parallelism: the batch itself
    outer, _ = _wrapped_gpt_like()
    outer.model_type = "wrapper"
    assert utils.get_model_type(outer) == "wrapper"

"""MegatronModule's sharded state dict (tensor-parallel tensors as their partition) and Float16Module; the
sharded-state-dict helpers of transformer.utils; IdentityOp."""

import pytest
import torch

from megatron.core.dist_checkpointing import logical_names
from megatron.core.dist_checkpointing.logical_names import TensorParallelRank
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint, sharded_state_dict_default


class _Block(MegatronModule):
    def __init__(self, config):
        super().__init__(config)
        init = torch.nn.init.ones_
        self.fc1 = ColumnParallelLinear(4, 6, config=config, init_method=init)
        self.fc2 = RowParallelLinear(6, 4, config=config, init_method=init, input_is_parallel=True)
        self.norm = torch.nn.LayerNorm(4)
        self.register_buffer("steps", torch.zeros(1))


def test_sharded_state_dict_places_tensor_parallel_partitions(monkeypatch):
    block = _Block(ModelParallelConfig())
    monkeypatch.setattr(logical_names, "current_tensor_parallel_rank", lambda: TensorParallelRank(1, 2))
    entries = block.sharded_state_dict(prefix="block.")
    assert set(entries) == {"block.steps", "block.fc1.weight", "block.fc1.bias", "block.fc2.weight",
                            "block.fc2.bias", "block.norm.weight", "block.norm.bias"}
    expected = {  # name: (global shape, offsets of this rank's piece)
        "block.fc1.weight": ((12, 4), (6, 0)), "block.fc1.bias": ((12,), (6,)),
        "block.fc2.weight": ((4, 12), (0, 6)), "block.fc2.bias": ((4,), (0,)),
        "block.norm.weight": ((4,), (0,)), "block.steps": ((1,), (0,)),
    }
    for key, (shape, offsets) in expected.items():
        assert tuple(entries[key].global_shape) == shape, key
        assert entries[key].piece_at(offsets) is not None
    assert entries["block.fc1.weight"].piece_at((6, 0)) is block.fc1.weight


def test_helpers_take_an_axis_map_and_keep_extra_state(monkeypatch):
    monkeypatch.setattr(logical_names, "current_tensor_parallel_rank", lambda: TensorParallelRank(0, 2))
    state = {"w": torch.ones(2, 3), "b": torch.ones(2), "_extra_state": {"k": 1}}
    entries = make_sharded_tensors_for_checkpoint(state, "x.", {"w": 0})
    assert tuple(entries["x.w"].global_shape) == (4, 3) and tuple(entries["x.b"].global_shape) == (2,)
    assert entries["x._extra_state"] == {"k": 1}
    with pytest.raises(ValueError, match="not in the state dict"):
        make_sharded_tensors_for_checkpoint(state, "", {"missing": 0})
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert set(sharded_state_dict_default(plain, "p.")) == {"p.0.weight", "p.0.bias"}


def test_float16_module_casts_inputs_and_outputs():
    config = ModelParallelConfig(bf16=True, params_dtype=torch.bfloat16)
    inner = torch.nn.Linear(3, 2)
    reference = torch.nn.Linear(3, 2).to(torch.bfloat16)
    reference.load_state_dict(inner.state_dict())
    wrapped = Float16Module(config, inner)
    assert wrapped.module.weight.dtype == torch.bfloat16
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    out = wrapped(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference(x.to(torch.bfloat16)).float(), atol=0, rtol=0)
    half_out = wrapped(x, fp32_output=False)  # upstream's switch: the output stays in the module's dtype
    assert half_out.dtype == torch.bfloat16 and torch.equal(half_out, reference(x.to(torch.bfloat16)))
    assert set(wrapped.state_dict()) == {"weight", "bias"}
    with pytest.raises(ValueError, match="--bf16"):
        Float16Module(ModelParallelConfig(), torch.nn.Linear(1, 1))


def test_identity_ops():
    x = torch.ones(2)
    assert IdentityOp(1, key=2)(x, "ignored", mask=None) is x
    assert IdentityFuncOp()(x)(x) is x

"""Upstream names offered for tools (modelopt imports them): megatron.core.mpu, the TE class names that exist
without transformer-engine and say so when used, PackedSeqParams, the parallel linear layers' GEMM function."""

import pytest
import torch
import torch.nn.functional as F

import megatron.core
from megatron.core import parallel_state
from megatron.core.extensions import transformer_engine as te_extension
from megatron.core.optional_deps import HAVE_TE
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import layers


def test_mpu_is_parallel_state():
    from megatron.core import mpu

    assert mpu is parallel_state and megatron.core.mpu is parallel_state
    with pytest.raises(AttributeError):
        megatron.core.not_a_name  # noqa: B018


@pytest.mark.skipif(HAVE_TE, reason="transformer-engine is installed: the names are the real layers")
@pytest.mark.parametrize("name", ["TEColumnParallelLinear", "TERowParallelLinear", "TELayerNormColumnParallelLinear"])
def test_te_layer_names_exist_and_say_what_to_do(name):
    cls = getattr(te_extension, name)
    assert issubclass(cls, torch.nn.Module) and cls is getattr(te_extension, name)
    with pytest.raises(RuntimeError, match="transformer-impl local"):
        cls(4, 4, config=None, init_method=None)


@pytest.mark.parametrize("name", ["TELinear", "TENorm", "TEDotProductAttention", "TEColumnParallelGroupedLinear",
                                  "TERowParallelGroupedLinear"])
def test_te_modules_not_built_here_say_so(name):
    with pytest.raises(RuntimeError, match="not built in this code base"):
        getattr(te_extension, name)()


def test_packed_seq_params_validates_offsets():
    params = PackedSeqParams(cu_seqlens_q=torch.tensor([0, 3, 5]), max_seqlen_q=3)
    assert params.qkv_format == "thd"
    with pytest.raises(ValueError, match="cu_seqlens_kv"):
        PackedSeqParams(cu_seqlens_kv=torch.tensor([0, 4, 2]))
    with pytest.raises(ValueError, match="qkv_format"):
        PackedSeqParams(qkv_format="tbd")


def test_linear_function_is_the_gemm_and_accumulates_into_main_grad():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, generator=generator, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(4, 3, generator=generator))
    bias = torch.randn(4, generator=generator)
    out = layers.linear_with_grad_accumulation_and_async_allreduce(x, weight, bias, False, allreduce_dgrad=False,
                                                                   sequence_parallel=False)
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=0, rtol=0)
    weight.main_grad = torch.zeros_like(weight)
    layers.linear_with_grad_accumulation_and_async_allreduce(x, weight, None, True, False, False).sum().backward()
    torch.testing.assert_close(weight.main_grad, torch.ones(5, 4).t() @ x.detach(), atol=1e-6, rtol=1e-6)
    with pytest.raises(NotImplementedError, match="grad_output_buffer"):
        layers.linear_with_grad_accumulation_and_async_allreduce(x, weight, None, False, False, False,
                                                                 grad_output_buffer=[])

"""`--no-fp8-wgrad` (the recipe's `fp8_wgrad` off): the FP8 linear's weight gradient equals the one the non-FP8
linear computes from the unquantized operands, while the forward and the input gradient stay FP8."""

import pytest
import torch

from megatron.core import fp8_utils
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.fp8.fp8_reference import reference_linear

EXACT_RTOL, EXACT_ATOL = 1e-5, 1e-5


def _run(recipe, x, weight, bias, grad):
    inputs = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
    out = fp8_utils.fp8_linear(*inputs, fp8_utils.LinearScaling(recipe, "none"))
    out.backward(grad)
    return out.detach(), *(t.grad for t in inputs)


@pytest.mark.parametrize("scaled_mm", [False, True])
def test_weight_gradient_is_the_high_precision_one_and_the_rest_stays_fp8(scaled_mm):
    hybrid = fp8_utils.get_fp8_format("hybrid")
    generator = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(*shape, generator=generator) for shape in ((16, 32), (48, 32), (48,)))
    grad = torch.randn(16, 48, generator=generator)
    fp8_recipe = fp8_utils.Fp8RecipeSettings(hybrid, "tensorwise")
    hp_wgrad_recipe = fp8_utils.Fp8RecipeSettings(hybrid, "tensorwise", fp8_wgrad=False)
    with fp8_utils.force_fp8_scaled_mm() if scaled_mm else fp8_utils.force_fp8_gemm_emulation():
        fp8_out, fp8_dgrad, fp8_wgrad, fp8_bgrad = _run(fp8_recipe, x, weight, bias, grad)
        out, dgrad, wgrad, bgrad = _run(hp_wgrad_recipe, x, weight, bias, grad)

    # The weight gradient: exactly the plain linear's g.T @ x, and not the FP8 one.
    assert torch.equal(wgrad, grad.t().matmul(x))
    assert not torch.allclose(wgrad, fp8_wgrad, rtol=1e-3, atol=1e-3)
    ref_out, ref_dgrad, ref_wgrad, _ = reference_linear(x, weight, bias, grad, hybrid.forward_dtype,
                                                        hybrid.backward_dtype)
    torch.testing.assert_close(fp8_wgrad.double(), ref_wgrad, rtol=EXACT_RTOL, atol=EXACT_ATOL)
    # The forward and the input gradient are the FP8 ones (FP8 operands on their grids), unchanged by the flag.
    assert torch.equal(out, fp8_out) and torch.equal(dgrad, fp8_dgrad) and torch.equal(bgrad, fp8_bgrad)
    torch.testing.assert_close(dgrad.double(), ref_dgrad, rtol=EXACT_RTOL, atol=EXACT_ATOL)
    torch.testing.assert_close(out.double(), ref_out, rtol=EXACT_RTOL, atol=EXACT_ATOL)
    assert not torch.allclose(dgrad, grad.matmul(weight), rtol=1e-3, atol=1e-3)


def test_config_flag_reaches_the_layer_and_the_main_grad_under_delayed_scaling():
    from megatron.core.extensions.transformer_engine import layer_classes

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, fp8="hybrid", fp8_recipe="delayed",
                               fp8_wgrad=False, gradient_accumulation_fusion=True, params_dtype=torch.bfloat16,
                               bf16=True)
    assert fp8_utils.Fp8RecipeSettings.from_config(config).fp8_wgrad is False
    torch.manual_seed(0)
    layer = layer_classes(config)[0](16, 32, config=config, init_method=torch.nn.init.normal_, bias=False)
    layer.weight.main_grad = torch.zeros(32, 16, dtype=torch.float32)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).requires_grad_(True)
    with fp8_utils.get_fp8_context(config, layer_no=0):
        out, _ = layer(x)
    grad = torch.randn(4, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out.backward(grad)
    # Computed in the activations' dtype (bf16), as the non-FP8 layer does, then added into the fp32 main grad.
    assert torch.equal(layer.weight.main_grad, grad.t().matmul(x.detach()).float())
    assert layer.weight.grad is None


@pytest.fixture
def validated(monkeypatch):
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
            "--train-iters 4 --lr 1e-3 --mock-data --vocab-size 128 ")
    return lambda extra: validate_args(parse_args(args=(base + extra).split()))


def test_wgrad_flags_reach_the_config(validated):
    from megatron.training.model_config import core_transformer_config_from_args

    assert core_transformer_config_from_args(validated("--fp8-format hybrid")).fp8_wgrad is True
    assert core_transformer_config_from_args(validated("--fp8-format hybrid --no-fp8-wgrad")).fp8_wgrad is False
    assert validated("--no-fp8-wgrad --fp8-wgrad").fp8_wgrad is True


def test_fp8_interval_is_ignored_with_upstreams_deprecation(validated):
    from megatron.training.model_config import core_transformer_config_from_args

    with pytest.warns(UserWarning, match="--fp8-interval 4 is deprecated upstream and ignored"):
        args = validated("--fp8-format hybrid --fp8-interval 4")
    plain = validated("--fp8-format hybrid")
    assert core_transformer_config_from_args(args) == core_transformer_config_from_args(plain)


def test_no_fp8_wgrad_with_a_te_recipe_without_the_override_stops(validated):
    with pytest.raises(ValueError, match="--no-fp8-wgrad with --transformer-impl transformer_engine needs --fp8-recipe "
                       "delayed"):
        validated("--fp8-format hybrid --fp8-recipe tensorwise --transformer-impl transformer_engine --no-fp8-wgrad")

"""The FP8 linear's weight handling: the FP8 weight is quantized once per optimizer step and reused by every
microbatch (gradient accumulation) until the step changes the weight; with `keep_fp8_transpose_cache` its
transposed bytes come from the same pass and feed the backward GEMM without a copy; the weight gradient is
produced in the dtype it accumulates in; the bias goes into `torch._scaled_mm` where it takes one."""

import pytest
import torch

from megatron.core import fp8_utils
from megatron.core.fp8.scaling import ScalingState
from megatron.core.transformer.transformer_config import TransformerConfig


def _layer(recipe, **config_overrides):
    from megatron.core.extensions.transformer_engine import layer_classes

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, fp8="hybrid", fp8_recipe=recipe,
                               fp8_amax_history_len=2, **config_overrides)
    torch.manual_seed(0)
    layer = layer_classes(config)[0](16, 32, config=config, init_method=torch.nn.init.normal_, bias=True)
    return layer, config


@pytest.fixture
def weight_quantizations(monkeypatch):
    """Counts quantizations of FP8 weights (tensors of the layer's weight shape)."""
    calls = []
    original = ScalingState.quantize

    def counting(self, tensor, with_transpose=False):
        if tensor.shape == (32, 16):
            calls.append(with_transpose)
        return original(self, tensor, with_transpose)

    monkeypatch.setattr(ScalingState, "quantize", counting)
    return calls


def _microbatch(layer, config, x):
    with fp8_utils.get_fp8_context(config, layer_no=0):
        out, _ = layer(x)
    out.square().sum().backward()
    return out.detach()


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_weight_is_quantized_once_per_step_under_gradient_accumulation(recipe, weight_quantizations):
    layer, config = _layer(recipe)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    # Before the training loop manages the layer (no step hook yet): quantized in every microbatch.
    for _ in range(2):
        _microbatch(layer, config, x)
    assert len(weight_quantizations) == 2
    outputs = []
    for step in range(3):
        fp8_utils.reduce_fp8_amaxes([layer])  # the step hook (the training loop runs it before optimizer.step)
        weight_quantizations.clear()
        outputs.append([_microbatch(layer, config, x) for _ in range(4)])  # four accumulated microbatches
        assert len(weight_quantizations) == 1, (step, weight_quantizations)  # hit in microbatches 2-4
        optimizer.step()
        optimizer.zero_grad()
        weight_quantizations.clear()
        _microbatch(layer, config, x)  # optimizer.step bumped the weight's version: a miss even without the hook
        assert len(weight_quantizations) == 1
        layer.weight.grad = None
    # The cached weight computes what a fresh quantization computes: within a step the outputs are identical.
    for step_outputs in outputs:
        for out in step_outputs[1:]:
            assert torch.equal(out, step_outputs[0])
    assert not torch.equal(outputs[0][0], outputs[1][0])  # the weight changed between steps


def test_weight_changed_behind_autograd_is_requantized_at_the_next_step():
    """Mixed-precision optimizers write `param.data` (no version bump): the step hook starts the cache anew."""
    layer, config = _layer("tensorwise")
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    fp8_utils.reduce_fp8_amaxes([layer])
    before = _microbatch(layer, config, x)
    layer.weight.data.copy_(layer.weight.data * 2)
    fp8_utils.reduce_fp8_amaxes([layer])
    after = _microbatch(layer, config, x)
    # Doubling the weight doubles the FP8 weight exactly (its scale halves, the bytes stay): output - bias doubles.
    torch.testing.assert_close(after - layer.bias.detach(), 2 * (before - layer.bias.detach()), rtol=1e-6, atol=1e-6)


def test_kept_transpose_feeds_the_backward_gemm_and_wgrad_lands_in_the_main_grad_dtype(monkeypatch,
                                                                                       weight_quantizations):
    layer, config = _layer("tensorwise", keep_fp8_transpose_cache=True, gradient_accumulation_fusion=True,
                           params_dtype=torch.bfloat16, bf16=True)
    layer.weight.main_grad = torch.zeros(32, 16, dtype=torch.float32)
    assert fp8_utils.scaled_mm_supported("cpu")  # probed once, before recording
    calls = []
    scaled_mm = torch._scaled_mm

    def recording(a, b, **kwargs):
        calls.append({"a": a, "b": b, "out_dtype": kwargs["out_dtype"], "bias": kwargs.get("bias")})
        return scaled_mm(a, b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).requires_grad_(True)
    fp8_utils.reduce_fp8_amaxes([layer])
    with fp8_utils.force_fp8_scaled_mm():
        _microbatch(layer, config, x)
        cached = layer._fp8_weight_cache[1]
        _microbatch(layer, config, x)
    assert weight_quantizations == [True]  # one quantization, which also wrote the transposed bytes
    assert cached.transpose_data is not None and torch.equal(cached.transpose_data, cached.data.t().contiguous())
    forward, dgrad, wgrad = calls[:3]
    # Forward: w.T is column-major as it is; the bias (bf16, like the output) goes into the kernel.
    assert forward["b"].data_ptr() == cached.data.data_ptr() and forward["b"].t().is_contiguous()
    assert forward["bias"] is layer.bias and forward["out_dtype"] == torch.bfloat16
    # Backward: dgrad reads the kept transposed bytes (column-major w), no copy of its own.
    assert dgrad["b"].data_ptr() == cached.transpose_data.data_ptr() and dgrad["b"].t().is_contiguous()
    # wgrad is produced in main_grad's dtype (fp32) for bf16 weights, from row-major / column-major operands.
    assert wgrad["out_dtype"] == torch.float32 and wgrad["a"].is_contiguous() and wgrad["b"].t().is_contiguous()
    assert layer.weight.grad is None and layer.weight.main_grad.abs().sum() > 0
    assert len(calls) == 6


def test_without_the_transpose_cache_the_weight_keeps_no_transpose(weight_quantizations):
    layer, config = _layer("tensorwise")
    fp8_utils.reduce_fp8_amaxes([layer])
    with fp8_utils.force_fp8_scaled_mm():
        _microbatch(layer, config, torch.randn(4, 16))
    assert weight_quantizations == [False] and layer._fp8_weight_cache[1].transpose_data is None

"""FP8 column- and row-parallel linear layers (torch-native backend) at TP=2.

Three references: (1) the same layers computed on one rank in fp32 from fake-quantized operands (quantize then
dequantize with per-tensor current scales over the *full* tensors, gradients quantized to the backward dtype):
the FP8 layers must equal it up to summation order, which shows that the TP shards agreed on one scale and
that every GEMM, forward and backward, saw FP8 operands; (2) the plain fp32 layers, within the error FP8
rounding allows; (3) `torch._scaled_mm` against dequantize-and-matmul emulation.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core import fp8_utils
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.tensor_parallel.tp_helpers import chunk, gather_partitions, setup_tensor_parallel, shared_randn

# Summation order differs between one fp32 GEMM and TP partial sums / _scaled_mm kernels.
EXACT_RTOL, EXACT_ATOL = 1e-5, 1e-5
# FP8 against fp32 (relative Frobenius error): e4m3 rounds each operand with a relative error of at most
# 2**-4 (RMS about 2**-4 / sqrt(3) = 0.036), e5m2 at most 2**-3; a product of two rounded operands and two
# chained layers stay near 0.07 forward and 0.1 backward for random data. Bounds leave ~2x headroom.
FORWARD_FP8_BOUND = 0.12
BACKWARD_FP8_BOUND = 0.2


class _FakeQuantize(torch.autograd.Function):
    """Forward: quantize-dequantize with the tensor's own current scale. Backward: identity."""

    @staticmethod
    def forward(ctx, tensor, dtype):
        return fp8_utils.dequantize(fp8_utils.quantize_with_current_scale(tensor, dtype), tensor.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _FakeQuantizeGrad(torch.autograd.Function):
    """Forward: identity. Backward: the incoming gradient quantize-dequantized to `dtype`."""

    @staticmethod
    def forward(ctx, tensor, dtype):
        ctx.dtype = dtype
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return fp8_utils.dequantize(fp8_utils.quantize_with_current_scale(grad, ctx.dtype), grad.dtype), None


def _reference_fp8_linear(x, weight, fmt):
    out = F.linear(_FakeQuantize.apply(x, fmt.forward_dtype), _FakeQuantize.apply(weight, fmt.forward_dtype))
    return _FakeQuantizeGrad.apply(out, fmt.backward_dtype)


def _relative_error(actual, expected):
    return ((actual - expected).norm() / expected.norm()).item()


def _run_pair(column, row, x, grad, recipe=None):
    """row(column(x)) forward and backward (inside an FP8 region when `recipe` is given)."""
    x = x.clone().requires_grad_(True)
    for param in (*column.parameters(), *row.parameters()):
        param.grad = None
    if recipe is None:
        hidden, _ = column(x)
        out, _ = row(hidden)
    else:
        with fp8_utils.Fp8Region(recipe):
            hidden, _ = column(x)
            out, _ = row(hidden)
    out.backward(grad)
    return out.detach(), x.grad, column.weight.grad, column.bias.grad, row.weight.grad, row.bias.grad


def _fp8_linear_on_ranks(fmt_name):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    config, tp_rank, tp_size = setup_tensor_parallel()
    torch.manual_seed(7)
    init = torch.nn.init.normal_
    column = ColumnParallelLinear(16, 24, config=config, init_method=lambda w: init(w, std=0.3), bias=True)
    row = RowParallelLinear(24, 16, config=config, init_method=lambda w: init(w, std=0.3), bias=True,
                            input_is_parallel=True)
    with torch.no_grad():
        column.bias.copy_(chunk(shared_randn(24, seed=3), 0, tp_rank, tp_size))
        row.bias.copy_(shared_randn(16, seed=4))
    x = shared_randn(5, 3, 16, seed=1)
    grad = shared_randn(5, 3, 16, seed=2)
    fmt = fp8_utils.get_fp8_format(fmt_name)
    recipe = fp8_utils.Fp8Recipe(fmt, "tensorwise")
    results = {}

    with fp8_utils.force_fp8_scaled_mm():  # on the CPU the default is emulation: run torch's kernel here
        fp8 = _run_pair(column, row, x, grad, recipe)
    fp32 = _run_pair(column, row, x, grad)
    emulated = _run_pair(column, row, x, grad, recipe)  # the CPU default

    # Reference on the full weights, in fp32, from fake-quantized operands.
    w1 = gather_partitions(column.weight.detach(), 0).requires_grad_(True)
    b1 = gather_partitions(column.bias.detach(), 0).requires_grad_(True)
    w2 = gather_partitions(row.weight.detach(), 1).requires_grad_(True)
    b2 = row.bias.detach().clone().requires_grad_(True)
    x_ref = x.clone().requires_grad_(True)
    hidden = _reference_fp8_linear(x_ref, w1, fmt) + b1
    out = _reference_fp8_linear(hidden, w2, fmt) + b2
    out.backward(grad)
    reference = (
        out.detach(), x_ref.grad, chunk(w1.grad, 0, tp_rank, tp_size), chunk(b1.grad, 0, tp_rank, tp_size),
        chunk(w2.grad, 1, tp_rank, tp_size), b2.grad,
    )
    names = ("output", "input grad", "column weight grad", "column bias grad", "row weight grad", "row bias grad")
    for name, actual, expected, emulated_value in zip(names, fp8, reference, emulated):
        torch.testing.assert_close(actual, expected, rtol=EXACT_RTOL, atol=EXACT_ATOL, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(actual, emulated_value, rtol=EXACT_RTOL, atol=EXACT_ATOL,
                                   msg=lambda m: f"{name} scaled_mm vs emulation: {m}")
    results["errors_vs_fp32"] = {name: _relative_error(a, e) for name, a, e in zip(names, fp8, fp32)}
    results["grad_dtype"] = str(column.fp8_scaling(recipe).grad_output.dtype)

    # Gradient-accumulation fusion: the FP8 weight gradient is added into main_grad instead of .grad.
    fused_config = type(config)(tensor_model_parallel_size=tp_size, gradient_accumulation_fusion=True)
    fused = ColumnParallelLinear(16, 24, config=fused_config, init_method=lambda w: w, bias=False)
    with torch.no_grad():
        fused.weight.copy_(column.weight)
    fused.weight.main_grad = torch.full_like(fused.weight, 1.0)
    x_plain = x.clone()
    with fp8_utils.Fp8Region(recipe):
        out_fused, _ = fused(x_plain)
    out_fused.backward(torch.ones_like(out_fused))
    column.weight.grad = None
    with fp8_utils.Fp8Region(recipe):
        out_plain, _ = column(x_plain)
    (out_plain - column.bias).backward(torch.ones_like(out_plain))
    assert fused.weight.grad is None
    torch.testing.assert_close(fused.weight.main_grad - 1.0, column.weight.grad, rtol=EXACT_RTOL, atol=EXACT_ATOL)
    return results


@pytest.mark.parametrize("fmt_name", ["e4m3", "hybrid"])
def test_fp8_linear_matches_fake_quantized_reference_and_tracks_fp32(fmt_name):
    results = run_on_ranks(2, _fp8_linear_on_ranks, fmt_name)
    expected_grad_dtype = "torch.float8_e5m2" if fmt_name == "hybrid" else "torch.float8_e4m3fn"
    for rank_results in results:
        assert rank_results["grad_dtype"] == expected_grad_dtype
        errors = rank_results["errors_vs_fp32"]
        assert errors["output"] < FORWARD_FP8_BOUND, errors
        for name in ("input grad", "column weight grad", "row weight grad"):
            assert 1e-3 < errors[name] < BACKWARD_FP8_BOUND, errors  # FP8 really in effect, and close
        assert errors["output"] > 1e-3, errors


def test_delayed_scaling_histories_are_module_buffers():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert not parallel_state.model_parallel_is_initialized()
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, fp8="e4m3",
                               fp8_amax_history_len=4)
    layer = ColumnParallelLinear(8, 8, config=config, init_method=torch.nn.init.ones_, bias=False)
    assert layer.state_dict()["fp8_amax_history"].shape == (3, 4)
    x = torch.full((2, 8), 0.5, requires_grad=True)
    for _ in range(2):
        with fp8_utils.get_fp8_context(config, layer_no=0):
            out, _ = layer(x)
        out.sum().backward()
    with fp8_utils.get_fp8_context(config, layer_no=0):
        layer(x)
    history = layer.state_dict()["fp8_amax_history"]
    # input amax 0.5 and weight amax 1 three times; the gradient amax (1.0) of the two backward passes.
    assert history.tolist() == [[0.5, 0.5, 0.5, 0.0], [1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
    assert layer.state_dict()["fp8_amax_recorded_count"].tolist() == [3, 3, 2]
    restored = ColumnParallelLinear(8, 8, config=config, init_method=torch.nn.init.ones_, bias=False)
    restored.load_state_dict(layer.state_dict())
    assert restored.fp8_scaling(fp8_utils.Fp8Recipe.from_config(config)).input.num_recorded == 3


def test_state_dict_without_fp8_histories_loads_strictly_and_starts_them_empty():
    """A non-FP8 layer's state dict loads strictly into a delayed-scaling layer (fine-tuning in FP8): weights
    load, the histories start empty and the load is counted; a state dict with only one of the two history
    buffers still fails on the other."""
    from megatron.core.fp8.checkpoint import count_fp8_histories_started_empty
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    plain_config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    fp8_config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, fp8="hybrid",
                                   fp8_amax_history_len=4)
    plain = ColumnParallelLinear(8, 8, config=plain_config, init_method=lambda w: torch.nn.init.normal_(w),
                                 bias=True)
    plain_state = plain.state_dict()
    assert sorted(plain_state) == ["bias", "weight"]
    layer = ColumnParallelLinear(8, 8, config=fp8_config, init_method=torch.nn.init.zeros_, bias=True)
    x = torch.full((2, 8), 0.5)
    with fp8_utils.get_fp8_context(fp8_config, layer_no=0):
        layer(x)  # records amaxes: loading must reset them
    assert layer.fp8_amax_recorded_count.tolist() == [1, 1, 0]

    result = layer.load_state_dict(plain_state, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(layer.weight, plain.weight) and torch.equal(layer.bias, plain.bias)
    assert torch.equal(layer.fp8_amax_history, torch.zeros(3, 4))
    assert layer.fp8_amax_recorded_count.tolist() == [0, 0, 0]
    assert count_fp8_histories_started_empty([layer]) == 1
    assert count_fp8_histories_started_empty([layer]) == 0  # counted once per load

    partial = {**plain_state, "fp8_amax_history": torch.ones(3, 4)}
    with pytest.raises(RuntimeError, match="fp8_amax_recorded_count"):
        layer.load_state_dict(partial, strict=True)


# GPU kernels and the CPU emulation accumulate in fp32 in different orders.
CUDA_VS_EMULATION_RTOL, CUDA_VS_EMULATION_ATOL = 1e-4, 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, in_features, out_features, scaled_mm_calls", [
    (64, 32, 48, 3),  # every GEMM dimension a multiple of 16: forward, dgrad and wgrad run torch._scaled_mm
    (50, 24, 40, 0),  # not: the kernels refuse such shapes, so all three fall back to emulation on the GPU
])
def test_fp8_linear_on_cuda_matches_the_emulation_reference(monkeypatch, tokens, in_features, out_features,
                                                           scaled_mm_calls):
    if not fp8_utils.scaled_mm_supported("cuda"):
        pytest.skip("this GPU has no FP8 torch._scaled_mm kernel (FP8 tensor cores need compute capability 8.9+)")
    recipe = fp8_utils.Fp8Recipe(fp8_utils.get_fp8_format("hybrid"), "tensorwise")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.3
    bias = torch.randn(out_features, generator=generator)
    grad = torch.randn(tokens, out_features, generator=generator)

    def run(device, emulate=False):
        inputs = [t.to(device).requires_grad_(True) for t in (x, weight, bias)]
        scaling = fp8_utils.LinearScaling(recipe, "none")
        with fp8_utils.force_fp8_gemm_emulation(emulate):
            out = fp8_utils.fp8_linear(*inputs, scaling)
            out.backward(grad.to(device))
        return [t.detach().cpu() for t in (out, *(i.grad for i in inputs))]

    calls = []
    scaled_mm = torch._scaled_mm

    def counting_scaled_mm(*args, **kwargs):
        calls.append(args[0].device.type)
        return scaled_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting_scaled_mm)
    reference = run("cpu", emulate=True)  # dequantize-and-matmul in fp32 on the CPU
    assert calls == []
    on_cuda = run("cuda")
    assert calls == ["cuda"] * scaled_mm_calls
    emulated_on_cuda = run("cuda", emulate=True)
    assert len(calls) == scaled_mm_calls
    names = ("output", "input grad", "weight grad", "bias grad")
    for name, actual, emulated, expected in zip(names, on_cuda, emulated_on_cuda, reference):
        torch.testing.assert_close(actual, expected, rtol=CUDA_VS_EMULATION_RTOL, atol=CUDA_VS_EMULATION_ATOL,
                                   msg=lambda m: f"{name}, CUDA vs CPU emulation: {m}")
        torch.testing.assert_close(emulated, expected, rtol=CUDA_VS_EMULATION_RTOL, atol=CUDA_VS_EMULATION_ATOL,
                                   msg=lambda m: f"{name}, CUDA emulation vs CPU emulation: {m}")


def test_cpu_gemm_policy_emulates_by_default_and_runs_scaled_mm_when_forced(monkeypatch):
    """On the CPU the FP8 GEMMs are emulated unless `force_fp8_scaled_mm()` asks for torch's kernel; both give
    the same numbers (float8 operands are exact in fp32)."""
    recipe = fp8_utils.Fp8Recipe(fp8_utils.get_fp8_format("hybrid"), "tensorwise")
    generator = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(*shape, generator=generator) for shape in ((8, 32), (16, 32), (16,)))
    grad = torch.randn(8, 16, generator=generator)
    assert fp8_utils.scaled_mm_supported("cpu")  # torch's CPU build has the kernel (probed once, before counting)
    calls = []
    scaled_mm = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or scaled_mm(*a, **k))

    def run():
        inputs = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
        out = fp8_utils.fp8_linear(*inputs, fp8_utils.LinearScaling(recipe, "none"))
        out.backward(grad)
        return [out.detach(), *(t.grad for t in inputs)]

    default = run()
    assert calls == []
    with fp8_utils.force_fp8_scaled_mm():
        forced = run()
    assert len(calls) == 3  # forward, dgrad and wgrad
    with fp8_utils.force_fp8_scaled_mm(), fp8_utils.force_fp8_gemm_emulation():
        run()
    assert len(calls) == 3  # the innermost choice wins
    for a, b in zip(default, forced):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)

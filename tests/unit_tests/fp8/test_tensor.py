"""FP8 quantization against the FP8 definitions (`fp8_reference.py`): saturation at 448 / 57344, round to
nearest even onto the e4m3 / e5m2 grids (normal and subnormal), scale = max / amax with a margin, for fp32 and
bf16 inputs; and the compiled kernels (CUDA's path) give the eager kernels' bytes."""

import pytest
import torch

from megatron.core.fp8 import tensor as fp8_tensor
from tests.unit_tests.fp8.fp8_reference import FP8_FACTS, round_to_fp8_grid

DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def _values(dtype):
    facts = FP8_FACTS[dtype]
    generator = torch.Generator().manual_seed(0)
    spacing_at_one = 2.0 ** -facts["mantissa_bits"]
    special = torch.tensor([
        0.0, -0.0, facts["max"], -facts["max"], 2 * facts["max"], -1e9,  # saturation
        1 + spacing_at_one / 2, 1 + 3 * spacing_at_one / 2, -(1 + spacing_at_one / 2),  # ties: to even
        facts["subnormal_spacing"] / 2, 3 * facts["subnormal_spacing"] / 2, facts["subnormal_spacing"] * 0.75,
    ])
    spread = torch.randn(4096, generator=generator) * torch.logspace(-7, 2.5, 4096)  # subnormals to saturation
    return torch.cat([special, spread]).to(torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_matches_the_fp8_grid_definition(dtype):
    values = _values(dtype)
    for scale in (1.0, 3.7, 0.01):
        scale_tensor = torch.tensor(scale)
        quantized = fp8_tensor.quantize(values, dtype, scale_tensor)
        expected = round_to_fp8_grid(values * scale_tensor, dtype)  # the product in fp32, then the grid
        assert torch.equal(quantized.data.to(torch.float64), expected), (dtype, scale)
    # The definition's ties and saturation, spelled out.
    spacing = 2.0 ** -FP8_FACTS[dtype]["mantissa_bits"]
    sub = FP8_FACTS[dtype]["subnormal_spacing"]
    data = fp8_tensor.quantize(values[:12], dtype, torch.tensor(1.0)).data.to(torch.float64).tolist()
    top = FP8_FACTS[dtype]["max"]
    assert data == [0.0, 0.0, top, -top, top, -top, 1.0, 1 + 2 * spacing, -1.0, 0.0, 2 * sub, sub]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("margin", [0, 2])
def test_current_scaling_scale_reciprocal_and_bf16_inputs(dtype, margin):
    values = _values(dtype)[12:] * 0.01
    for source in (values, values.to(torch.bfloat16)):
        quantized = fp8_tensor.quantize_with_current_scale(source, dtype, margin)
        amax = source.to(torch.float32).abs().max()
        expected_scale = torch.tensor(FP8_FACTS[dtype]["max"] / 2.0**margin, dtype=torch.float32) / amax
        assert torch.equal(quantized.scale, expected_scale)
        assert torch.equal(quantized.scale_inv, expected_scale.reciprocal())
        expected = round_to_fp8_grid(source.to(torch.float32) * expected_scale, dtype)
        assert torch.equal(quantized.data.to(torch.float64), expected)
        assert quantized.data.float().abs().max().item() == FP8_FACTS[dtype]["max"] / 2.0**margin


def test_amax_is_max_abs_and_propagates_nan():
    values = torch.tensor([0.5, -3.0, 2.0])
    assert fp8_tensor.amax(values).item() == 3.0 and fp8_tensor.amax(values.to(torch.bfloat16)).dtype == torch.float32
    assert fp8_tensor.amax(torch.empty(0)).item() == 0.0
    assert torch.isnan(fp8_tensor.amax(torch.tensor([1.0, float("nan")])))
    nan_scale = fp8_tensor.scale_from_amax(torch.tensor(float("nan")), torch.float8_e4m3fn)
    assert nan_scale.item() == 1.0  # a bad amax cannot poison the scale


def _compiled_against_eager(monkeypatch, backend, device):
    monkeypatch.setattr(fp8_tensor, "_COMPILE_OVERRIDE", [True])
    monkeypatch.setattr(fp8_tensor, "_COMPILE_BACKEND", [backend])
    monkeypatch.setattr(fp8_tensor, "_COMPILED", {})
    monkeypatch.setattr(fp8_tensor, "_COMPILE_FAILED", [])
    values = _values(torch.float8_e4m3fn)[12:].reshape(64, 64).to(device)
    compiled = fp8_tensor.quantize_by_amax(values, torch.float8_e4m3fn, fp8_tensor.amax(values), with_transpose=True)
    assert not fp8_tensor._COMPILE_FAILED, fp8_tensor._COMPILE_FAILED  # whole-graph capture, no fallback
    assert set(fp8_tensor._COMPILED)  # the compiled functions ran
    monkeypatch.setattr(fp8_tensor, "_COMPILE_OVERRIDE", [False])
    eager = fp8_tensor.quantize_by_amax(values, torch.float8_e4m3fn, fp8_tensor.amax(values), with_transpose=True)
    assert torch.equal(compiled.scale, eager.scale) and torch.equal(compiled.scale_inv, eager.scale_inv)
    assert torch.equal(compiled.data.view(torch.uint8), eager.data.view(torch.uint8))
    assert torch.equal(compiled.transpose_data.view(torch.uint8), eager.data.t().contiguous().view(torch.uint8))


def test_compiled_kernels_capture_whole_graphs_and_write_the_eager_bytes(monkeypatch):
    """The torch.compile'd amax and scale-and-cast (CUDA's path) traced on the CPU (fullgraph, dynamic shapes)
    with the aot_eager backend: no graph break, and the same scale and bytes as the eager kernels."""
    _compiled_against_eager(monkeypatch, "aot_eager", "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's generated FP8 kernels are checked on CUDA")
def test_inductor_kernels_write_the_eager_bytes_on_cuda(monkeypatch):
    _compiled_against_eager(monkeypatch, "inductor", "cuda")

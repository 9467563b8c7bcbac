"""The Triton quantization kernels (`megatron/core/fp8/triton_quantize.py`) against the eager path: the same
amax, scale, reciprocal and float8 bytes (and transposed bytes). On the CPU they run under Triton's interpreter
(`TRITON_INTERPRET=1`); on a GPU compiled, through the public quantize functions."""

import os
import subprocess
import sys

import pytest
import torch

from megatron.core.fp8 import tensor as fp8_tensor
from megatron.core.fp8 import triton_quantize
from megatron.core.fp8.formats import fp8_max
from megatron.core.fp8.recipe import Fp8RecipeSettings
from megatron.core.fp8.scaling import ScalingState
from megatron.core.fp8_utils import get_fp8_format

DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _wide_range_values(shape, source_dtype, seed):
    """Normal values spread over 11 decades, with -0.0 and a value below every float8 subnormal."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator) * torch.logspace(-8, 3, shape[-1])
    flat = values.view(-1)
    flat[0], flat[1] = -0.0, 1e-30
    return values.to(source_dtype)


# Exactly halfway between neighbours of the e4m3 grid (1.0625, -1.1875, 2**-10 between 0 and the smallest
# subnormal) and of the e5m2 grid (1.125, -1.375, 2**-17), and values on the grids: quantized with scale 1.
HALFWAY = torch.tensor([[1.0625, -1.1875, 0.0009765625, 1.125, -1.375, 2.0**-17, 3.0, -448.0, 0.5, -0.0]])


def _assert_matches_eager(values, dtype, margin, with_transpose):
    eager_amax = fp8_tensor._amax_eager(values)
    amax = triton_quantize.amax(values)
    assert torch.equal(amax[0], eager_amax)
    limit = fp8_max(dtype)
    data, transpose, scale, scale_inv, own_amax = triton_quantize.quantize(
        values, dtype, amax, margin, with_transpose=with_transpose, record_amax=True)
    want_data, want_transpose, want_scale, want_scale_inv = fp8_tensor._scale_and_cast_eager(
        values, eager_amax, dtype, limit / 2.0**margin, limit, with_transpose)
    assert torch.equal(scale, want_scale) and torch.equal(scale_inv, want_scale_inv)
    assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))
    assert torch.equal(own_amax, eager_amax)
    if with_transpose:
        assert torch.equal(transpose.view(torch.uint8), want_transpose.view(torch.uint8))
    else:
        assert transpose is None


def check_interpreted_kernels_write_the_eager_bytes():
    for dtype in DTYPES:
        for source_dtype in (torch.float32, torch.bfloat16):
            for index, (shape, margin) in enumerate((((37, 70), 0), ((64, 128), 1), ((9,), 0))):
                values = _wide_range_values(shape, source_dtype, seed=index)
                _assert_matches_eager(values, dtype, margin, with_transpose=len(shape) == 2)
        # Several blocks per amax program (a power of two), and a scale from another tensor's amax that saturates.
        values = _wide_range_values((512, 600), torch.bfloat16, seed=7)
        assert triton_quantize._blocks_per_program(values) == 2
        _assert_matches_eager(values, dtype, 0, with_transpose=False)
        limit = fp8_max(dtype)
        unit_scale_amax = torch.tensor([limit])  # scale = limit / amax = 1
        data, *_ = triton_quantize.quantize(HALFWAY, dtype, unit_scale_amax)
        want = fp8_tensor._scale_and_cast_eager(HALFWAY, unit_scale_amax[0], dtype, limit, limit, False)[0]
        assert torch.equal(data.view(torch.uint8), want.view(torch.uint8)), (data, want)
        small_amax = torch.tensor([1e-3])
        values = _wide_range_values((37, 70), torch.bfloat16, seed=7)
        data, *_ = triton_quantize.quantize(values, dtype, small_amax)
        want = fp8_tensor._scale_and_cast_eager(values, small_amax[0], dtype, limit, limit, False)[0]
        assert torch.equal(data.view(torch.uint8), want.view(torch.uint8))
        assert data.float().abs().max().item() == limit


def check_interpreted_amax_counts_nan_as_inf_and_bad_amaxes_give_scale_one():
    values = torch.tensor([[1.0, float("nan"), -3.0, 2.0]])
    assert triton_quantize.amax(values).item() == float("inf")
    for bad in (0.0, float("inf"), float("nan")):
        _, _, scale, scale_inv, _ = triton_quantize.quantize(values[:, 2:], torch.float8_e4m3fn, torch.tensor([bad]))
        assert scale.item() == 1.0 and scale_inv.item() == 1.0


def check_interpreted_scales_start_allocations_of_their_own():
    # cuBLASLt takes a scale pointer only at the start of an allocation (an H200 refused one 4 bytes in).
    for record_amax in (False, True):
        _, _, scale, scale_inv, _ = triton_quantize.quantize(HALFWAY, torch.float8_e4m3fn, torch.tensor([1792.0]),
                                                             record_amax=record_amax)
        for tensor in (scale, scale_inv):
            assert tensor.dim() == 0 and tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == 4
        assert scale.item() == 0.25 and scale_inv.item() == 4.0  # 448 / 1792 and back


def check_interpreted_kernels_pass_the_first_use_check():
    fp8_tensor._check_triton_kernels(torch.device("cpu"))
    assert not fp8_tensor._TRITON_FAILED, fp8_tensor._TRITON_FAILED


def _eager_kernel_outputs(tensor, dtype, with_transpose):
    """What the quantize kernel returns, computed by the eager functions (current scaling)."""
    limit = fp8_max(dtype)
    amax = fp8_tensor._amax_eager(tensor)
    data, transpose, scale, scale_inv = fp8_tensor._scale_and_cast_eager(tensor, amax, dtype, limit, limit,
                                                                          with_transpose)
    return data, transpose, scale, scale_inv, amax


def _replace_kernels(monkeypatch, quantize):
    monkeypatch.setattr(triton_quantize, "amax", lambda tensor: fp8_tensor._amax_eager(tensor).reshape(1))
    monkeypatch.setattr(triton_quantize, "quantize", quantize)


def test_first_use_check_hands_over_to_the_other_paths_when_the_kernels_disagree(monkeypatch):
    """Kernels whose bytes differ from the eager path's (one float8 byte off) are not used: the check records
    why, and quantizing goes on through the eager path."""
    monkeypatch.setattr(fp8_tensor, "_TRITON_FAILED", [])

    def one_byte_off(tensor, dtype, scale_amax, margin=0, with_transpose=False, record_amax=False):
        data, transpose, scale, scale_inv, amax = _eager_kernel_outputs(tensor, dtype, with_transpose)
        data = data.clone()
        data.view(torch.uint8)[0, 5] += 1
        return data, transpose, scale, scale_inv, amax

    _replace_kernels(monkeypatch, one_byte_off)
    fp8_tensor._check_triton_kernels(torch.device("cpu"))
    assert len(fp8_tensor._TRITON_FAILED) == 1 and "do not reproduce the eager" in fp8_tensor._TRITON_FAILED[0]


def test_first_use_check_hands_over_when_scaled_mm_refuses_the_kernels_operands(monkeypatch):
    """Kernels with the eager bytes and scales, but a scale `torch._scaled_mm` refuses (here: one that is a view
    4 bytes into another tensor, as cuBLASLt refused on an H200), are not used: the check records the GEMM's
    error, and quantizing goes on through the other paths."""
    monkeypatch.setattr(fp8_tensor, "_TRITON_FAILED", [])

    def scales_in_one_tensor(tensor, dtype, scale_amax, margin=0, with_transpose=False, record_amax=False):
        data, transpose, scale, scale_inv, amax = _eager_kernel_outputs(tensor, dtype, with_transpose)
        scales = torch.stack([scale, scale_inv])
        return data, transpose, scales[0], scales[1], amax

    scaled_mm = torch._scaled_mm

    def refusing_offset_scales(a, b, scale_a, scale_b, **kwargs):
        if scale_a.storage_offset() or scale_b.storage_offset():
            raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul")
        return scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, **kwargs)

    _replace_kernels(monkeypatch, scales_in_one_tensor)
    monkeypatch.setattr(torch, "_scaled_mm", refusing_offset_scales)
    fp8_tensor._check_triton_kernels(torch.device("cpu"))
    assert len(fp8_tensor._TRITON_FAILED) == 1 and "CUBLAS_STATUS_NOT_SUPPORTED" in fp8_tensor._TRITON_FAILED[0]
    assert not fp8_tensor._triton_kernels_take(torch.ones(4, 4), torch.float8_e4m3fn)


def test_interpreted_kernels_write_the_eager_bytes_and_handle_bad_amaxes():
    """The kernels under Triton's CPU interpreter, which must be on before Triton is first imported: in a child
    process with `TRITON_INTERPRET=1`."""
    pytest.importorskip("triton", reason="Triton is not installed (`pip install -e .[dev]` installs it)")
    checks = ("check_interpreted_kernels_write_the_eager_bytes",
              "check_interpreted_amax_counts_nan_as_inf_and_bad_amaxes_give_scale_one",
              "check_interpreted_scales_start_allocations_of_their_own",
              "check_interpreted_kernels_pass_the_first_use_check")
    code = "import tests.unit_tests.fp8.test_triton_quantize as t; " + "; ".join(f"t.{name}()" for name in checks)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    completed = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                               timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]


def test_the_kernels_take_only_cuda_float_tensors_of_at_most_two_dimensions():
    assert not triton_quantize.supports(torch.ones(4, 4), torch.float8_e4m3fn)  # the CPU runs the eager path
    if torch.cuda.is_available() and triton_quantize.have_triton():
        cuda = torch.ones(4, 4, device="cuda")
        assert triton_quantize.supports(cuda, torch.float8_e4m3fn)
        assert not triton_quantize.supports(cuda.view(2, 2, 4), torch.float8_e4m3fn)
        assert not triton_quantize.supports(cuda.to(torch.int32), torch.float8_e4m3fn)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_kernels_write_the_eager_bytes(dtype):
    if not triton_quantize.have_triton():
        pytest.skip("Triton is not importable on this GPU machine")
    for source_dtype in (torch.float32, torch.bfloat16, torch.float16):
        for index, (shape, margin) in enumerate((((37, 70), 0), ((256, 384), 1), ((2048, 4096), 0), ((9,), 0))):
            values = _wide_range_values(shape, torch.float32, seed=index)
            if source_dtype == torch.float16:
                values = values.clamp(-6e4, 6e4)
            _assert_matches_eager(values.to(source_dtype).cuda(), dtype, margin, with_transpose=len(shape) == 2)


@pytest.mark.gpu
def test_cuda_scaling_states_quantize_through_the_kernels_with_the_eager_results():
    """Current scaling through `quantize_by_amax`, and delayed scaling's one-pass quantize-and-record, on CUDA
    give the eager path's bytes, scales and recorded amaxes."""
    if not triton_quantize.have_triton():
        pytest.skip("Triton is not importable on this GPU machine")
    fmt = get_fp8_format("hybrid")
    values = [_wide_range_values((256, 512), torch.bfloat16, seed=seed).cuda() for seed in range(3)]
    for recipe in (Fp8RecipeSettings(fmt, "tensorwise"), Fp8RecipeSettings(fmt, "delayed", amax_history_len=4,
                                                           amax_compute_algo="max")):
        results = {}
        for path in ("kernels", "eager"):
            state = ScalingState(recipe, fmt.forward_dtype, sharded_over_tensor_parallel=False)
            original = fp8_tensor._triton_kernels_take
            if path == "eager":
                # The eager functions themselves: torch.compile'd ones may round the reciprocal differently.
                fp8_tensor._triton_kernels_take = lambda tensor, dtype: False
                fp8_tensor._COMPILE_OVERRIDE[0] = False
            try:
                outputs = []
                for step, tensor in enumerate(values):
                    quantized = state.quantize(tensor, with_transpose=True)
                    outputs.append((quantized.data.view(torch.uint8), quantized.transpose_data.view(torch.uint8),
                                    quantized.scale, quantized.scale_inv))
                    if recipe.is_delayed:
                        outputs.append((state.pending_amax.clone(),))
                        from megatron.core.fp8.scaling import reduce_and_record_amaxes

                        reduce_and_record_amaxes([state], [])
                        outputs.append((state.amax_history.clone(),))
            finally:
                fp8_tensor._triton_kernels_take = original
                fp8_tensor._COMPILE_OVERRIDE[0] = None
            results[path] = outputs
        for mine, eager in zip(results["kernels"], results["eager"]):
            for a, b in zip(mine, eager):
                assert torch.equal(a, b)


def test_triton_quantization_switch_is_scoped(monkeypatch):
    """`triton_quantization(False)` turns the kernels off inside its block only, also when the block raises."""
    monkeypatch.setattr(fp8_tensor, "_TRITON_FAILED", [])
    monkeypatch.setattr(fp8_tensor, "_TRITON_CHECKED_DEVICES", {torch.device("cpu")})
    monkeypatch.setattr(triton_quantize, "supports", lambda tensor, dtype: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # the kernels' gate, on the CPU
    values = torch.ones(4, 4)
    assert fp8_tensor._triton_kernels_take(values, torch.float8_e4m3fn)
    with fp8_tensor.triton_quantization(False):
        assert not fp8_tensor._triton_kernels_take(values, torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="inside"):
        with fp8_tensor.triton_quantization(False):
            raise RuntimeError("inside")
    assert fp8_tensor._triton_kernels_take(values, torch.float8_e4m3fn)

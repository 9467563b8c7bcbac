"""FP8 tensors: float8 data plus the fp32 scale it was quantized with (and its reciprocal, computed once).

`quantize(x, dtype, scale)` stores `saturate(x * scale)` in `dtype` (the product in fp32, rounded to nearest
even onto the float8 grid); `dequantize` returns `data * scale_inv` with `scale_inv = 1 / scale` (fp32).
Every float8 value is exact in fp32, so a dequantized tensor is what an FP8 GEMM computes with (up to the one
rounding of the scale), and re-quantizing it with the same scale returns the same bytes.

Quantizing takes as few passes over memory, and as few launches, as the device allows. On a GPU with Triton
the amax is one kernel and the scale-and-cast another, which also writes the transposed bytes when asked for and,
under delayed scaling, records the tensor's amax in the same pass (`triton_quantize`): a handful of launches per
tensor, so the host keeps ahead of the GPU. Tensors those kernels do not take (more than two dimensions) go
through `torch.compile`d functions on CUDA; where compiling fails they run eagerly and a message says so once.
Elsewhere (the CPU) they run eagerly: the amax is one infinity-norm pass (no `abs` temporary), and the cast is one
multiply (in fp32, without a separate upcast copy), an in-place clamp and the float8 conversion.
"""

import contextlib
import logging
from typing import NamedTuple

import torch

from megatron.core.fp8.formats import fp8_max, is_fp8_dtype

logger = logging.getLogger(__name__)


class ScaledFloat8:
    """`data` (a float8 tensor) and `scale` (fp32 scalar tensor): the value is `data.float() * scale_inv`. A plain
    holder of the two, not a `torch.Tensor` subclass: FP8 GEMMs take it, autograd and other ops do not.

    `transpose_data`, when present, is `data.t().contiguous()` (kept where a backward GEMM needs the other
    layout: `--keep-fp8-transpose-cache`)."""

    __slots__ = ("data", "scale", "_scale_inv", "transpose_data")

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor = None,
                 transpose_data: torch.Tensor = None):
        if not is_fp8_dtype(data.dtype):
            raise TypeError(f"ScaledFloat8 data must have a float8 dtype, got {data.dtype}")
        self.data = data
        self.scale = scale
        self._scale_inv = scale_inv
        self.transpose_data = transpose_data

    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def scale_inv(self) -> torch.Tensor:
        if self._scale_inv is None:
            self._scale_inv = self.scale.reciprocal()
        return self._scale_inv

    def t(self) -> "ScaledFloat8":
        """The transposed FP8 tensor: the kept transposed bytes when there are some, else a view (no copy)."""
        if self.transpose_data is not None:
            return ScaledFloat8(self.transpose_data, self.scale, self._scale_inv, transpose_data=self.data)
        return ScaledFloat8(self.data.t(), self.scale, self._scale_inv, transpose_data=self.data)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return (self.data.to(torch.float32) * self.scale_inv).to(dtype)

    def __repr__(self):
        return f"ScaledFloat8(shape={tuple(self.data.shape)}, dtype={self.data.dtype})"


def _te_float8_tensor_class():
    from megatron.core.optional_deps import HAVE_TE

    if not HAVE_TE:
        return None
    try:
        from transformer_engine.pytorch.float8_tensor import Float8Tensor as TEFloat8Tensor
    except Exception:  # moved between TE releases; no TE class means nothing to recognise
        return None
    return TEFloat8Tensor


def is_float8tensor(tensor) -> bool:
    """True for this package's `ScaledFloat8` and for Transformer Engine's Float8Tensor when TE is present."""
    if isinstance(tensor, ScaledFloat8):
        return True
    te_class = _te_float8_tensor_class()
    return te_class is not None and isinstance(tensor, te_class)


# ---- eager kernels ------------------------------------------------------------------------------------------------


def _amax_eager(tensor: torch.Tensor) -> torch.Tensor:
    # One op and one pass: the infinity norm is max(|x|) (exact in any precision, no `abs` temporary), reduced in
    # fp32 for 16-bit inputs; NaN propagates.
    if tensor.dtype == torch.float64:
        return torch.linalg.vector_norm(tensor, float("inf")).to(torch.float32)
    return torch.linalg.vector_norm(tensor, float("inf"), dtype=torch.float32)


# The positive finite fp32 range: a scale outside it (or NaN) is replaced by 1.
_SMALLEST_POSITIVE_FP32 = torch.finfo(torch.float32).smallest_normal * 2.0**-23
_LARGEST_FP32 = torch.finfo(torch.float32).max


def _scale_eager(amax_value: torch.Tensor, limit: float) -> torch.Tensor:
    if amax_value.dtype != torch.float32:
        amax_value = amax_value.to(torch.float32)
    # `limit * (1 / amax)`: the two roundings of `limit / amax` as a tensor computes it (and as the Triton kernel
    # reproduces), into a new tensor that the rest updates in place.
    scale = torch.reciprocal(amax_value).mul_(limit)
    # amax 0, inf, NaN, negative or so small that the scale overflows: scale 1 (all-zero tensors stay zero, and a
    # bad amax cannot poison the scale). Clamping to the positive finite range changes exactly those (NaN stays
    # NaN, which compares unequal).
    outside = scale.clamp(_SMALLEST_POSITIVE_FP32, _LARGEST_FP32).ne(scale)
    return scale.masked_fill_(outside, 1.0)


def _cast_eager(tensor: torch.Tensor, multiplier: torch.Tensor, dtype: torch.dtype, limit: float) -> torch.Tensor:
    # The scale as a one-element (not 0-dim) tensor, `multiplier`, takes part in type promotion: a bf16 tensor is
    # multiplied in fp32 and no fp32 copy of it is made first.
    scaled = tensor * multiplier
    return scaled.clamp_(-limit, limit).to(dtype)


def _scale_and_cast_eager(tensor, amax_value, dtype, target, limit, with_transpose):
    # `target` (the float8 maximum / 2**margin) is what the amax maps onto; `limit` the saturation bound.
    scale = _scale_eager(amax_value, target)
    data = _cast_eager(tensor, scale.reshape(1), dtype, limit)
    transpose = data.t().contiguous() if with_transpose else None
    return data, transpose, scale, torch.reciprocal(scale)


# ---- compiled kernels (CUDA) ---------------------------------------------------------------------------------------

_COMPILED = {}
_COMPILE_FAILED = []
# None: compile on CUDA only; True / False: force (tests run the compiled functions on the CPU).
_COMPILE_OVERRIDE = [None]
# The torch.compile backend: inductor generates the fused kernels; tests on the CPU trace the same functions with
# "aot_eager" (the whole-graph capture without code generation, which takes minutes for the CPU).
_COMPILE_BACKEND = ["inductor"]


def _wants_compiled(tensor: torch.Tensor) -> bool:
    if _COMPILE_FAILED:
        return False
    if _COMPILE_OVERRIDE[0] is not None:
        return _COMPILE_OVERRIDE[0]
    return tensor.is_cuda


def _compiled(key, function):
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(function, dynamic=True, fullgraph=True, backend=_COMPILE_BACKEND[0])
    return _COMPILED[key]


def _run(key, eager, tensor, *args):
    """`eager(tensor, *args)`, compiled (one compiled function per `key`, a tuple) where `_wants_compiled`."""
    if _wants_compiled(tensor):
        try:
            return _compiled(key, eager)(tensor, *args)
        except Exception as error:  # no working compiler / backend here: stay eager from now on
            _COMPILE_FAILED.append(repr(error))
            logger.warning("FP8 quantization runs eagerly: torch.compile of its kernels failed (%s)", error)
    return eager(tensor, *args)


def without_autograd(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` detached where an op on it would be recorded by autograd (the FP8 linear quantizes inside its
    autograd function, where nothing is: no `detach` op is dispatched then)."""
    return tensor.detach() if tensor.requires_grad and torch.is_grad_enabled() else tensor


# ---- public API ---------------------------------------------------------------------------------------------------


_TRITON_FAILED = []
_TRITON_DISABLED = [False]


@contextlib.contextmanager
def triton_quantization(enabled: bool):
    """Within the block, quantize through the Triton kernels where they apply (`enabled`, the default) or through
    the `torch.compile`d / eager functions (benchmarks compare the two)."""
    previous = _TRITON_DISABLED[0]
    _TRITON_DISABLED[0] = not enabled
    try:
        yield
    finally:
        _TRITON_DISABLED[0] = previous


_TRITON_CHECKED_DEVICES = set()


def _triton_kernels_take(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    if _COMPILE_OVERRIDE[0] is not None or not tensor.is_cuda or _TRITON_FAILED or _TRITON_DISABLED[0]:
        return False
    from megatron.core.fp8 import triton_quantize

    if not triton_quantize.supports(tensor, dtype):
        return False
    if tensor.device not in _TRITON_CHECKED_DEVICES:
        _TRITON_CHECKED_DEVICES.add(tensor.device)
        _check_triton_kernels(tensor.device)
    return not _TRITON_FAILED


def _check_triton_kernels(device):
    """Once per device, before the kernels quantize anything: they must reproduce the eager path's amax, scale
    and bytes (both float8 formats, with the transposed bytes and the recorded amax) on a probe tensor with
    values across the float8 range, and `torch._scaled_mm` must take their e4m3 operands as it takes the eager
    ones; otherwise the other paths take over and the log says why."""
    from megatron.core.fp8 import triton_quantize

    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(48, 80, generator=generator) * torch.logspace(-6, 3, 80)
    probe[0, :4] = torch.tensor([-0.0, 1e-30, 1.0625, -1.1875])
    try:
        for source in (probe.to(device), probe.to(device=device, dtype=torch.bfloat16)):
            eager_amax = _amax_eager(source)
            amax_value = triton_quantize.amax(source)
            for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                limit = fp8_max(dtype)
                data, transpose, scale, scale_inv, own = triton_quantize.quantize(
                    source, dtype, amax_value, 0, with_transpose=True, record_amax=True)
                want = _scale_and_cast_eager(source, eager_amax, dtype, limit, limit, True)
                same = (torch.equal(amax_value[0], eager_amax) and torch.equal(own, eager_amax)
                        and torch.equal(data.view(torch.uint8), want[0].view(torch.uint8))
                        and torch.equal(transpose.view(torch.uint8), want[1].view(torch.uint8))
                        and torch.equal(scale, want[2]) and torch.equal(scale_inv, want[3]))
                if not same:
                    _triton_failed(f"on {device} they do not reproduce the eager {dtype} quantization")
                    return
                if dtype == torch.float8_e4m3fn and not _scaled_mm_takes_like_eager(data, scale_inv, want):
                    _triton_failed(f"on {device} torch._scaled_mm gives another product from their operands")
                    return
    except Exception as error:  # noqa: BLE001 - any build or launch failure: fall back
        _triton_failed(error)


def _scaled_mm_takes_like_eager(data, scale_inv, eager) -> bool:
    """Whether `torch._scaled_mm` multiplies the kernels' bytes and scale (`data @ data.t()`) to the product of
    the eager path's: their outputs must be usable as GEMM operands, not only equal in value. True where the
    eager operands have no FP8 GEMM here either (then the GEMMs are emulated and take anything)."""
    def product(matrix, reciprocal):
        return torch._scaled_mm(matrix, matrix.t(), scale_a=reciprocal, scale_b=reciprocal, out_dtype=torch.float32)

    if not hasattr(torch, "_scaled_mm"):
        return True
    try:
        expected = product(eager[0], eager[3])
    except Exception:  # noqa: BLE001 - no FP8 GEMM for these operands on this device
        return True
    return torch.equal(product(data, scale_inv), expected)


def _triton_failed(error):
    """A Triton kernel did not build or launch here: the other paths from now on, said once."""
    _TRITON_FAILED.append(repr(error))
    logger.warning("FP8 quantization leaves its Triton kernels for torch.compile'd / eager ones: %s", error)


def amax(tensor: torch.Tensor) -> torch.Tensor:
    """max(|tensor|) as an fp32 scalar tensor (0 for an empty tensor). No host synchronisation. On a GPU with
    Triton one pass and one launch (a NaN counts as +inf there: either gives the scale of a bad amax, 1)."""
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=tensor.device)
    if _triton_kernels_take(tensor, torch.float8_e4m3fn):
        from megatron.core.fp8 import triton_quantize

        try:
            return triton_quantize.amax(without_autograd(tensor))[0]
        except Exception as error:  # noqa: BLE001 - any build or launch failure: fall back
            _triton_failed(error)
    return _run(("amax",), _amax_eager, without_autograd(tensor))


def scale_from_amax(amax_value: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """The scale that maps `amax_value` onto the largest float8 value divided by 2**margin.

    An amax of 0 (or a non-finite one) gives scale 1, so all-zero tensors stay zero and a bad amax cannot
    poison the scale.
    """
    return _scale_eager(amax_value, fp8_max(dtype) / (2.0**margin))


class Scales(NamedTuple):
    """A scale computed ahead of the tensors it quantizes: `scale` (fp32, 0-dim), `scale_inv` (its reciprocal) and
    `multiplier` (the scale as a one-element tensor, the form the cast multiplies by)."""

    scale: torch.Tensor
    scale_inv: torch.Tensor
    multiplier: torch.Tensor


def scales_from_amax(amax_value: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> Scales:
    """`scale_from_amax(amax_value, dtype, margin)` in the forms `quantize_with_scales` takes."""
    scale = scale_from_amax(amax_value, dtype, margin)
    return Scales(scale, torch.reciprocal(scale), scale.reshape(1))


def _check_fp8(dtype):
    if not is_fp8_dtype(dtype):
        raise ValueError(f"quantize needs a float8 dtype, got {dtype}")


def quantize(tensor: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> ScaledFloat8:
    """`tensor * scale`, saturated to the float8 range, stored in `dtype`."""
    _check_fp8(dtype)
    scale = scale.detach().to(torch.float32)
    data = _run(("cast", dtype), _cast_eager, without_autograd(tensor), scale.reshape(1), dtype, fp8_max(dtype))
    return ScaledFloat8(data, scale)


def quantize_by_amax(tensor: torch.Tensor, dtype: torch.dtype, amax_value: torch.Tensor, margin: int = 0,
                     with_transpose: bool = False) -> ScaledFloat8:
    """Quantize with the scale of `amax_value` (`scale_from_amax`): the scale, its reciprocal, the float8 bytes
    (and with `with_transpose` the transposed bytes of a 2-D tensor) from one pass."""
    _check_fp8(dtype)
    if _triton_kernels_take(tensor, dtype):
        from megatron.core.fp8 import triton_quantize

        try:
            data, transpose, scale, scale_inv, _ = triton_quantize.quantize(
                without_autograd(tensor), dtype, amax_value, margin, with_transpose=with_transpose)
            return ScaledFloat8(data, scale, scale_inv, transpose)
        except Exception as error:  # noqa: BLE001 - any build or launch failure: fall back
            _triton_failed(error)
    limit = fp8_max(dtype)
    data, transpose, scale, scale_inv = _run(("scale_and_cast", dtype, with_transpose), _scale_and_cast_eager,
                                             without_autograd(tensor), amax_value, dtype, limit / (2.0**margin), limit,
                                             with_transpose)
    return ScaledFloat8(data, scale, scale_inv, transpose)


def _cast_with_transpose_eager(tensor, multiplier, dtype, limit, with_transpose):
    data = _cast_eager(tensor, multiplier, dtype, limit)
    return data, data.t().contiguous() if with_transpose else None


def quantize_with_scales(tensor: torch.Tensor, dtype: torch.dtype, scales: Scales,
                         with_transpose: bool = False) -> ScaledFloat8:
    """`tensor` cast to `dtype` with a scale known beforehand (`scales_from_amax`), which the result holds as it
    is; with `with_transpose` also the transposed bytes of a 2-D tensor. The same bytes as `quantize_by_amax`
    with the amax the scale came from."""
    data, transpose = _run(("cast_with_transpose", dtype, with_transpose), _cast_with_transpose_eager,
                           without_autograd(tensor), scales.multiplier, dtype, fp8_max(dtype), with_transpose)
    return ScaledFloat8(data, scales.scale, scales.scale_inv, transpose)


def fused_amax_recording_available(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `quantize_recording_amax` takes this tensor in one pass (a GPU with Triton whose kernels passed
    their first-use check)."""
    return _triton_kernels_take(tensor, dtype)


def quantize_recording_amax(tensor: torch.Tensor, dtype: torch.dtype, scale_amax: torch.Tensor, margin: int = 0,
                            with_transpose: bool = False):
    """(`quantize_by_amax(tensor, dtype, scale_amax, ...)`, this tensor's own amax) from one pass over `tensor`:
    delayed scaling quantizes with the history's amax and records the new one. Only where
    `fused_amax_recording_available`."""
    from megatron.core.fp8 import triton_quantize

    _check_fp8(dtype)
    data, transpose, scale, scale_inv, own_amax = triton_quantize.quantize(
        without_autograd(tensor), dtype, scale_amax, margin, with_transpose=with_transpose, record_amax=True)
    return ScaledFloat8(data, scale, scale_inv, transpose), own_amax


def quantize_with_current_scale(tensor: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> ScaledFloat8:
    """Quantize with the scale computed from this tensor's own amax (per-tensor current scaling)."""
    return quantize_by_amax(tensor, dtype, amax(tensor), margin)


def dequantize(fp8_tensor: ScaledFloat8, dtype=torch.float32) -> torch.Tensor:
    return fp8_tensor.dequantize(dtype)


def dequantize_fp8_tensor(fp8_tensor) -> torch.Tensor:
    """The high-precision value of an FP8 tensor: a `ScaledFloat8` in fp32 (it has no other nominal dtype), a
    Transformer Engine Float8Tensor in its own nominal dtype."""
    if is_float8tensor(fp8_tensor):
        return fp8_tensor.dequantize()
    raise TypeError(f"dequantize_fp8_tensor: fp8_tensor must be a ScaledFloat8 or Transformer Engine Float8Tensor "
                    f"(is_float8tensor), got {type(fp8_tensor).__name__}; a plain float8 torch.Tensor carries no "
                    f"scale: use `.float()` and divide by the scale it was quantized with")


def modify_underlying_storage(tensor: ScaledFloat8, new_raw_data: torch.Tensor) -> None:
    """Move the FP8 bytes of `tensor` into `new_raw_data` (e.g. a view into a flat buffer): its current bytes are
    copied there and `tensor.data` becomes a view of it. `new_raw_data` is contiguous, holds as many elements as
    `tensor`, and is uint8 or `tensor`'s float8 dtype."""
    if not isinstance(tensor, ScaledFloat8):
        raise TypeError(f"modify_underlying_storage: tensor must be a ScaledFloat8 (this package's FP8 tensor), got "
                        f"{type(tensor).__name__}; Transformer Engine's Float8Tensor storage is managed by "
                        f"Transformer Engine (transformer_engine.pytorch.tensor.utils.replace_raw_data)")
    old = tensor.data
    if new_raw_data.dtype not in (torch.uint8, old.dtype):
        raise TypeError(f"modify_underlying_storage: new_raw_data must be uint8 or {old.dtype}, got "
                        f"{new_raw_data.dtype}")
    if new_raw_data.numel() != old.numel() or not new_raw_data.is_contiguous():
        raise ValueError(f"modify_underlying_storage: new_raw_data must be contiguous with {old.numel()} elements "
                         f"(tensor's shape {tuple(old.shape)}), got shape {tuple(new_raw_data.shape)}"
                         f"{'' if new_raw_data.is_contiguous() else ', not contiguous'}")
    new_data = new_raw_data.detach().view(old.dtype).view(old.shape)
    if new_data.data_ptr() != old.data_ptr():
        new_data.copy_(old)
    tensor.data = new_data

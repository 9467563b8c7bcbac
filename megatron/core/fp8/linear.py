"""The torch-native FP8 linear: `y = x @ w.T + b` with both GEMMs of the backward pass also in FP8.

Forward quantizes the input and the weight to the recipe's forward dtype (or takes an FP8 weight the
parameter already carries, see `--fp8-param-gather`) and keeps the FP8 copies for backward (1 byte per
element). Backward quantizes the output gradient to the backward dtype (e5m2 under `hybrid`) and computes
`dgrad = g @ w` and `wgrad = g.T @ x` from FP8 operands (with `--no-fp8-wgrad`, the recipe's `fp8_wgrad` off,
`wgrad` comes from the high-precision `g` and `x` instead, as the non-FP8 linear computes it, and the layer keeps
`x` in its own dtype for that rather than in FP8). The bias and its gradient stay in high precision;
`torch._scaled_mm` adds the bias itself where it takes one (an output in the bias's dtype, bf16 or fp16 on GPUs).

Layouts: `_scaled_mm` multiplies a row-major operand by a column-major one. The weight GEMM of the forward pass
fits as it is; the input's transposed bytes (for the weight gradient) come out of the input's quantizing pass,
the output gradient's likewise, and the weight's from its quantizing pass when the layer keeps it
(`--keep-fp8-transpose-cache`), so the backward makes no transposed copy of its own then. The weight gradient is
produced in the dtype it accumulates in (`main_grad`'s under gradient-accumulation fusion, else the weight's).

A GEMM runs through `torch._scaled_mm` on an accelerator that has a kernel for it, else it is emulated: the
operands are dequantized (exactly, float8 values are fp32 values) and multiplied in fp32, which gives the same
product up to summation order (both scales are applied to the fp32 product, as `_scaled_mm` does). A GEMM
whose dimensions are not multiples of 16 (what the GPU kernels take) is zero-padded to them when that adds at
most `PAD_WORK_LIMIT` work, else emulated, which the log says once per layer and shape (`gemm_plan`). On the CPU
emulation is the default even where torch has a `_scaled_mm` kernel: that kernel converts its operands before an
fp32-class GEMM too, and its speed varies by orders of magnitude
between x86 CPUs (1024x128x384 on one thread: 1.41 s against 4.2 ms emulated on an AMX Xeon; comparable to
emulation on an AMD EPYC). `force_fp8_scaled_mm()` runs it there anyway (tests of that path).
"""

import contextlib
import functools
import logging

import torch

from megatron.core.fp8.tensor import ScaledFloat8
from megatron.core.fused_weight_grad import weight_grad_after_main_grad

logger = logging.getLogger(__name__)

# None: the default policy (`_scaled_mm` on accelerators that have it, emulation on the CPU); "emulate" or
# "scaled_mm" while one of the contexts below is active.
_GEMM_OVERRIDE = [None]


@contextlib.contextmanager
def _override_gemm(mode):
    previous = _GEMM_OVERRIDE[0]
    _GEMM_OVERRIDE[0] = mode
    try:
        yield
    finally:
        _GEMM_OVERRIDE[0] = previous


def force_fp8_gemm_emulation(enabled: bool = True):
    """Run FP8 GEMMs by dequantize-and-matmul even where `torch._scaled_mm` would be used (tests, benchmarks)."""
    return _override_gemm("emulate" if enabled else _GEMM_OVERRIDE[0])


def force_fp8_scaled_mm():
    """Run FP8 GEMMs through `torch._scaled_mm` wherever the device has a kernel, the CPU included."""
    return _override_gemm("scaled_mm")


@functools.cache
def scaled_mm_supported(device_type: str) -> bool:
    """Whether `torch._scaled_mm` multiplies e4m3 x e4m3 and e5m2 x e4m3 on this kind of device."""
    if not hasattr(torch, "_scaled_mm"):
        return False
    try:
        device = torch.device(device_type)
        one = torch.ones((), dtype=torch.float32, device=device)
        a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        g = torch.ones(16, 16, device=device).to(torch.float8_e5m2)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        torch._scaled_mm(g, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        return True
    except Exception:  # no kernel for this device / dtype pair
        return False


# A GEMM whose dimensions are not all multiples of 16 (what the GPU kernels take) is padded with zeros when that
# adds at most this much work, else emulated (said once per layer and shape in the log).
PAD_WORK_LIMIT = 1.25
_EMULATION_REPORTED = set()


def _needs_multiples_of_16(device_type: str) -> bool:
    # GPU kernels want every dimension a multiple of 16; the CPU kernel takes any shape.
    return device_type != "cpu"


def _round_up_16(size: int) -> int:
    return -(-size // 16) * 16


def scaled_mm_in_use(device_type: str) -> bool:
    """Whether FP8 GEMMs on this kind of device go to `torch._scaled_mm` (shapes permitting), under the current
    policy: accelerators with a kernel, the CPU only inside `force_fp8_scaled_mm()`."""
    mode = _GEMM_OVERRIDE[0]
    if mode == "emulate" or (mode is None and device_type == "cpu"):
        return False
    return scaled_mm_supported(device_type)


def gemm_plan(device_type: str, m: int, k: int, n: int) -> str:
    """How an `[m, k] x [k, n]` FP8 GEMM runs: "scaled_mm", "pad" (zero-padded to multiples of 16 for
    `torch._scaled_mm`, the result sliced back) or "emulate" (dequantize-and-matmul)."""
    if not scaled_mm_in_use(device_type):
        return "emulate"
    if not _needs_multiples_of_16(device_type) or all(size % 16 == 0 for size in (m, k, n)):
        return "scaled_mm"
    padded = _round_up_16(m) * _round_up_16(k) * _round_up_16(n)
    return "pad" if padded <= PAD_WORK_LIMIT * m * k * n else "emulate"


def _report_emulated(label, m, k, n):
    key = (label, m, k, n)
    if key in _EMULATION_REPORTED:
        return
    _EMULATION_REPORTED.add(key)
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.warning("FP8 GEMM %s [%d x %d] x [%d x %d] runs emulated (dequantize-and-matmul): its dimensions are "
                       "not multiples of 16 and padding would add more than %d%% work", label or "(unnamed)", m, k,
                       k, n, round(100 * (PAD_WORK_LIMIT - 1)))


def _is_column_major(matrix: torch.Tensor) -> bool:
    """`matrix.t().is_contiguous()`, read from the strides (no transposed view is made to ask)."""
    rows, cols = matrix.shape
    row_stride, col_stride = matrix.stride()
    return rows * cols == 0 or ((rows == 1 or row_stride == 1) and (cols == 1 or col_stride == rows))


def _row_major(tensor: ScaledFloat8) -> torch.Tensor:
    if tensor.data.is_contiguous():
        return tensor.data
    if tensor.transpose_data is not None and _is_column_major(tensor.transpose_data):
        return tensor.transpose_data.t()
    return tensor.data.contiguous()


def _column_major(tensor: ScaledFloat8) -> torch.Tensor:
    if _is_column_major(tensor.data):
        return tensor.data
    if tensor.transpose_data is not None and tensor.transpose_data.is_contiguous():
        return tensor.transpose_data.t()
    return tensor.data.t().contiguous().t()


def _pad_bytes(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A row-major float8 matrix zero-padded to `[rows, cols]` (zero bytes are +0.0 in both float8 formats)."""
    padded = torch.nn.functional.pad(data.view(torch.uint8), (0, cols - data.shape[1], 0, rows - data.shape[0]))
    return padded.view(data.dtype)


def _bias_folds(bias, out_dtype, device_type):
    # _scaled_mm adds a bias of the output's dtype; CUDA kernels take none with an fp32 output.
    return bias is not None and bias.dtype == out_dtype and (out_dtype != torch.float32 or device_type == "cpu")


def fp8_gemm(a: ScaledFloat8, b: ScaledFloat8, out_dtype: torch.dtype, bias: torch.Tensor = None,
             accumulate_into: torch.Tensor = None, label: str = None):
    """`dequant(a) @ dequant(b) (+ bias)` for 2-D FP8 operands (`b` may be a transposed view, e.g. `w.t()`), in
    `out_dtype`. With `accumulate_into` the product is added into that tensor instead (returns None).

    `torch._scaled_mm` gets a row-major `a` and a column-major `b`, taken from the operands' own layouts or their
    kept transposes (`ScaledFloat8.transpose_data`) where these fit, so no transposed copy is made then."""
    m, k = a.shape
    n = b.shape[1]
    device_type = a.data.device.type
    plan = gemm_plan(device_type, m, k, n)
    if plan == "emulate":
        if scaled_mm_in_use(device_type):
            _report_emulated(label, m, k, n)
        # float8 values are exact in fp32: one fp32 GEMM of the raw values, then both scales applied to the product
        # (as _scaled_mm does), with the bias or the accumulation in the same pass.
        product = torch.matmul(a.data.to(torch.float32), b.data.to(torch.float32))
        scale = a.scale_inv * b.scale_inv
        if accumulate_into is not None:
            accumulate_into.addcmul_(product, scale.to(accumulate_into.dtype))
            return None
        if bias is not None:
            return torch.addcmul(bias.to(torch.float32), product, scale).to(out_dtype)
        return product.mul_(scale).to(out_dtype)
    a_data, b_data = _row_major(a), _column_major(b)
    if plan == "pad":
        rows, inner, cols = _round_up_16(m), _round_up_16(k), _round_up_16(n)
        a_data = _pad_bytes(a_data, rows, inner)
        b_data = _pad_bytes(b_data.t(), cols, inner).t()
    fold = plan == "scaled_mm" and _bias_folds(bias, out_dtype, device_type)
    out = torch._scaled_mm(a_data, b_data, scale_a=a.scale_inv, scale_b=b.scale_inv,
                           bias=bias if fold else None, out_dtype=out_dtype)
    if plan == "pad":
        out = out[:m, :n]
    if bias is not None and not fold:
        out = out + bias
    if accumulate_into is not None:
        accumulate_into.add_(out)
        return None
    return out


def _weight_grad_target(weight, accumulate_into_main_grad):
    """`weight.main_grad` when the weight gradient is accumulated there (gradient-accumulation fusion), else
    None; and the dtype the weight gradient is produced in (the main gradient's, or the weight's)."""
    if accumulate_into_main_grad and hasattr(weight, "main_grad"):
        return weight.main_grad, weight.main_grad.dtype
    return None, weight.dtype


def _high_precision_weight_grad(grad_2d, input_2d, grad_dtype, main_grad):
    """`g.T @ x` from the unquantized operands, computed as the non-FP8 linear does (in the activations' dtype),
    added into `main_grad` when given (returns None then), else returned in `grad_dtype`."""
    grad_weight = grad_2d.t().matmul(input_2d)
    if main_grad is not None:
        main_grad.add_(grad_weight.to(main_grad.dtype))
        return None
    return grad_weight.to(grad_dtype)


def _pack(fp8: ScaledFloat8):
    return fp8.data, fp8.transpose_data, fp8.scale, fp8.scale_inv


def _unpack(data, transpose_data, scale, scale_inv):
    if data is None:  # only the transposed bytes were kept
        data = transpose_data.t()
    return ScaledFloat8(data, scale, scale_inv, transpose_data)


class Fp8LinearFunction(torch.autograd.Function):
    """Autograd function of the torch-native FP8 linear; see the module docstring."""

    @staticmethod
    def forward(ctx, input_, weight, bias, scaling, weight_fp8, accumulate_into_main_grad, label):
        input_2d = input_.reshape(-1, input_.shape[-1])
        on_scaled_mm = scaled_mm_in_use(input_.device.type)
        needs_weight_grad = ctx.needs_input_grad[1]
        fp8_wgrad = scaling.recipe.fp8_wgrad
        # The weight gradient reads the input column-major: under _scaled_mm its transposed bytes come from the
        # quantizing pass and are all that is kept for backward.
        input_fp8 = scaling.input.quantize(input_2d, with_transpose=on_scaled_mm and needs_weight_grad and fp8_wgrad)
        if weight_fp8 is None:
            # The input gradient reads the weight column-major: its transposed bytes come from the same pass.
            weight_fp8 = scaling.weight.quantize(weight, with_transpose=on_scaled_mm and ctx.needs_input_grad[0])
        output = fp8_gemm(input_fp8, weight_fp8.t(), input_.dtype, bias=bias, label=label)
        if not needs_weight_grad:
            saved_input = (None, None, None, None)
        elif fp8_wgrad:
            saved_input = _pack(input_fp8)
            if saved_input[1] is not None:
                saved_input = (None, *saved_input[1:])
        else:  # the weight gradient reads the input in its own dtype
            saved_input = (input_2d, None, None, None)
        ctx.save_for_backward(*saved_input, *_pack(weight_fp8), weight)
        ctx.scaling = scaling
        ctx.has_bias = bias is not None
        ctx.input_shape = input_.shape
        ctx.input_dtype = input_.dtype
        ctx.accumulate_into_main_grad = accumulate_into_main_grad
        ctx.label = label
        return output.view(*input_.shape[:-1], output.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        saved = ctx.saved_tensors
        weight = saved[8]
        weight_fp8 = _unpack(*saved[4:8])
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        needs_weight_grad = ctx.needs_input_grad[1]
        on_scaled_mm = scaled_mm_in_use(grad_output.device.type)
        fp8_wgrad = ctx.scaling.recipe.fp8_wgrad
        grad_fp8 = ctx.scaling.grad_output.quantize(grad_2d,
                                                    with_transpose=on_scaled_mm and needs_weight_grad and fp8_wgrad)

        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = fp8_gemm(grad_fp8, weight_fp8, ctx.input_dtype, label=ctx.label).view(ctx.input_shape)
        grad_weight = None
        if needs_weight_grad:
            main_grad, grad_dtype = _weight_grad_target(weight, ctx.accumulate_into_main_grad)
            if fp8_wgrad:
                input_fp8 = _unpack(*saved[0:4])
                grad_weight = fp8_gemm(grad_fp8.t(), input_fp8, grad_dtype, accumulate_into=main_grad,
                                       label=ctx.label)
            else:
                grad_weight = _high_precision_weight_grad(grad_2d, saved[0], grad_dtype, main_grad)
            if main_grad is not None:
                grad_weight = weight_grad_after_main_grad(weight)
        grad_bias = grad_2d.sum(dim=0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None, None


def fp8_linear(input_, weight, bias, scaling, weight_fp8=None, accumulate_into_main_grad=False, label=None):
    """`input_ @ weight.T + bias` with FP8 GEMMs (forward and backward) scaled by `scaling` (`LinearScaling`).

    `weight_fp8`: the weight already in FP8 (gathered by `--fp8-param-gather`, or cached for the step by the
    layer), else it is quantized here. `label` names the layer in log lines."""
    return Fp8LinearFunction.apply(input_, weight, bias, scaling, weight_fp8, accumulate_into_main_grad, label)

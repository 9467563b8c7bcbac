"""The torch-native FP8 linear: `y = x @ w.T + b` with both GEMMs of the backward pass also in FP8.

Forward quantizes the input and the weight to the recipe's forward dtype (or takes an FP8 weight the
parameter already carries, see `--fp8-param-gather`) and keeps the FP8 copies for backward (1 byte per
element). Backward quantizes the output gradient to the backward dtype (e5m2 under `hybrid`) and computes
`dgrad = g @ w` and `wgrad = g.T @ x` from FP8 operands. The bias and its gradient stay in high precision.

A GEMM runs through `torch._scaled_mm` on an accelerator that has a kernel for it, else it is emulated: the
operands are dequantized (exactly, float8 values are fp32 values) and multiplied in fp32, which gives the same
product up to summation order. On the CPU emulation is the default even where torch has a `_scaled_mm` kernel:
that kernel converts its operands before an fp32-class GEMM too, and its speed varies by orders of magnitude
between x86 CPUs (1024x128x384 on one thread: 1.41 s against 4.2 ms emulated on an AMX Xeon; comparable to
emulation on an AMD EPYC). `force_fp8_scaled_mm()` runs it there anyway (tests of that path).
"""

import contextlib
import functools

import torch

from megatron.core.fp8.tensor import Float8Tensor

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


def _shapes_fit_scaled_mm(a, b):
    # GPU kernels want every dimension a multiple of 16; the CPU kernel takes any shape.
    if a.device.type == "cpu":
        return True
    return all(size % 16 == 0 for size in (*a.shape, b.shape[1]))


def uses_scaled_mm(a: torch.Tensor, b: torch.Tensor) -> bool:
    mode = _GEMM_OVERRIDE[0]
    if mode == "emulate" or (mode is None and a.device.type == "cpu"):
        return False
    return scaled_mm_supported(a.device.type) and _shapes_fit_scaled_mm(a, b)


def fp8_gemm(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype, transpose_b: bool = False) -> torch.Tensor:
    """`dequant(a) @ dequant(b)` (`b.T` when `transpose_b`) for 2-D FP8 operands, in `out_dtype`."""
    a_data = a.data
    b_data = b.data.t() if transpose_b else b.data
    if uses_scaled_mm(a_data, b_data):
        # _scaled_mm wants a row-major first operand and a column-major second one.
        a_row_major = a_data.contiguous()
        b_column_major = b_data.t().contiguous().t()
        return torch._scaled_mm(
            a_row_major, b_column_major, scale_a=a.scale_inv, scale_b=b.scale_inv, out_dtype=out_dtype
        )
    a_values = a_data.to(torch.float32) * a.scale_inv
    b_values = b_data.to(torch.float32) * b.scale_inv
    return torch.matmul(a_values, b_values).to(out_dtype)


def route_weight_grad_to_main_grad(weight, grad_weight):
    """With gradient-accumulation fusion: add `grad_weight` into `weight.main_grad` and return what autograd
    should receive (zeros when the weight has `grad_added_to_main_grad`, so gradient hooks still run)."""
    weight.main_grad.add_(grad_weight.to(weight.main_grad.dtype))
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return torch.zeros_like(weight)
    return None


class Fp8LinearFunction(torch.autograd.Function):
    """Autograd function of the torch-native FP8 linear; see the module docstring."""

    @staticmethod
    def forward(ctx, input_, weight, bias, scaling, weight_fp8, accumulate_into_main_grad):
        input_2d = input_.reshape(-1, input_.shape[-1])
        input_fp8 = scaling.input.quantize(input_2d)
        if weight_fp8 is None:
            weight_fp8 = scaling.weight.quantize(weight)
        output = fp8_gemm(input_fp8, weight_fp8, input_.dtype, transpose_b=True)
        if bias is not None:
            output = output + bias
        ctx.save_for_backward(input_fp8.data, input_fp8.scale, weight_fp8.data, weight_fp8.scale, weight)
        ctx.scaling = scaling
        ctx.has_bias = bias is not None
        ctx.input_shape = input_.shape
        ctx.input_dtype = input_.dtype
        ctx.accumulate_into_main_grad = accumulate_into_main_grad
        return output.view(*input_.shape[:-1], output.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        input_data, input_scale, weight_data, weight_scale, weight = ctx.saved_tensors
        input_fp8 = Float8Tensor(input_data, input_scale)
        weight_fp8 = Float8Tensor(weight_data, weight_scale)
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        grad_fp8 = ctx.scaling.grad_output.quantize(grad_2d)

        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = fp8_gemm(grad_fp8, weight_fp8, ctx.input_dtype).view(ctx.input_shape)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_output_t = Float8Tensor(grad_fp8.data.t(), grad_fp8.scale)
            grad_weight = fp8_gemm(grad_output_t, input_fp8, torch.float32)
            if ctx.accumulate_into_main_grad and hasattr(weight, "main_grad"):
                grad_weight = route_weight_grad_to_main_grad(weight, grad_weight)
            else:
                grad_weight = grad_weight.to(weight.dtype)
        grad_bias = grad_2d.sum(dim=0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None


def fp8_linear(input_, weight, bias, scaling, weight_fp8=None, accumulate_into_main_grad=False):
    """`input_ @ weight.T + bias` with FP8 GEMMs (forward and backward) scaled by `scaling` (`LinearScaling`)."""
    return Fp8LinearFunction.apply(input_, weight, bias, scaling, weight_fp8, accumulate_into_main_grad)

"""Independent FP8 reference for tests: the float8 grids written out from their definitions, in fp64.

e4m3fn: 3 mantissa bits, largest finite value 448, subnormal spacing 2**-9; e5m2: 2 mantissa bits, largest
finite value 57344, subnormal spacing 2**-16. A value `v` (saturated to +-max) lies in a binade `[2**(e-1),
2**e)` (`frexp`), where representable values are spaced `2**(e - 1 - mantissa_bits)`, never finer than the
subnormal spacing; it rounds to the nearest multiple of that spacing, ties to even (`torch.round`).
Per-tensor scaling: `scale = max / amax` (fp32), the quantizer multiplies in fp32, and the represented value
is `q / scale`. Nothing here calls the code under test.
"""

import torch

FP8_FACTS = {
    torch.float8_e4m3fn: {"max": 448.0, "mantissa_bits": 3, "subnormal_spacing": 2.0**-9},
    torch.float8_e5m2: {"max": 57344.0, "mantissa_bits": 2, "subnormal_spacing": 2.0**-16},
}


def round_to_fp8_grid(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`values` saturated and rounded (nearest, ties to even) onto the float8 grid of `dtype`, in fp64."""
    facts = FP8_FACTS[dtype]
    values = values.to(torch.float64).clamp(-facts["max"], facts["max"])
    _, exponent = torch.frexp(values)
    spacing = torch.ldexp(torch.ones_like(values), exponent - 1 - facts["mantissa_bits"])
    spacing = spacing.clamp(min=facts["subnormal_spacing"])
    return torch.round(values / spacing) * spacing  # exact: dividing by a power of two


def reference_scale(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 `max / amax` of the tensor's own amax (1 for an all-zero tensor)."""
    amax = tensor.detach().to(torch.float32).abs().max()
    if amax == 0:
        return torch.tensor(1.0)
    return torch.tensor(FP8_FACTS[dtype]["max"], dtype=torch.float32) / amax


def fake_quantize_reference(tensor: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor = None) -> torch.Tensor:
    """The value an FP8 GEMM sees for `tensor` (current per-tensor scaling unless `scale` is given), in fp64."""
    scale = reference_scale(tensor, dtype) if scale is None else scale.to(torch.float32)
    scaled = tensor.detach().to(torch.float32) * scale  # the quantizer's product, in fp32
    return round_to_fp8_grid(scaled, dtype) / scale.to(torch.float64)


def reference_linear(x, weight, bias, grad, forward_dtype, backward_dtype):
    """Forward and backward of `x @ weight.T + bias` with every GEMM operand on its FP8 grid, GEMMs in fp64:
    (output, input grad, weight grad, bias grad), all fp64 (no gradients when `grad` is None). `x` and `grad`
    are 2-D."""
    xq = fake_quantize_reference(x, forward_dtype)
    wq = fake_quantize_reference(weight, forward_dtype)
    out = xq @ wq.T
    if bias is not None:
        out = out + bias.to(torch.float64)
    if grad is None:
        return out, None, None, None
    gq = fake_quantize_reference(grad, backward_dtype)
    bias_grad = grad.to(torch.float64).sum(0) if bias is not None else None
    return out, gq @ wq, gq.T @ xq, bias_grad

"""FP8 tensors: float8 data plus the fp32 scale it was quantized with.

`quantize(x, dtype, scale)` stores `saturate(x * scale)` in `dtype`; `dequantize` returns `data * (1 / scale)`.
Every float8 value is exact in fp32, so a dequantized tensor is exactly what an FP8 GEMM computes with, and
re-quantizing it with the same scale returns the same bytes.
"""

import torch

from megatron.core.fp8.formats import fp8_max, is_fp8_dtype


class Float8Tensor:
    """`data` (a float8 tensor) and `scale` (fp32 scalar tensor): the value is `data.float() / scale`."""

    __slots__ = ("data", "scale")

    def __init__(self, data: torch.Tensor, scale: torch.Tensor):
        if not is_fp8_dtype(data.dtype):
            raise TypeError(f"Float8Tensor data must have a float8 dtype, got {data.dtype}")
        self.data = data
        self.scale = scale

    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def scale_inv(self) -> torch.Tensor:
        return self.scale.reciprocal()

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return (self.data.to(torch.float32) * self.scale_inv).to(dtype)

    def __repr__(self):
        return f"Float8Tensor(shape={tuple(self.data.shape)}, dtype={self.data.dtype}, scale={float(self.scale):.6g})"


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
    """True for this package's `Float8Tensor` and for Transformer Engine's Float8Tensor when TE is present."""
    if isinstance(tensor, Float8Tensor):
        return True
    te_class = _te_float8_tensor_class()
    return te_class is not None and isinstance(tensor, te_class)


def amax(tensor: torch.Tensor) -> torch.Tensor:
    """max(|tensor|) as an fp32 scalar tensor (0 for an empty tensor)."""
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=tensor.device)
    return tensor.detach().abs().max().to(torch.float32)


def scale_from_amax(amax_value: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """The scale that maps `amax_value` onto the largest float8 value divided by 2**margin.

    An amax of 0 (or a non-finite one) gives scale 1, so all-zero tensors stay zero and a bad amax cannot
    poison the scale.
    """
    amax_value = amax_value.to(torch.float32)
    scale = (fp8_max(dtype) / (2.0**margin)) / amax_value
    usable = torch.isfinite(amax_value) & (amax_value > 0) & torch.isfinite(scale) & (scale > 0)
    return torch.where(usable, scale, torch.ones_like(scale))


def quantize(tensor: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> Float8Tensor:
    """`tensor * scale`, saturated to the float8 range, stored in `dtype`."""
    if not is_fp8_dtype(dtype):
        raise ValueError(f"quantize needs a float8 dtype, got {dtype}")
    limit = fp8_max(dtype)
    scaled = tensor.detach().to(torch.float32) * scale
    data = scaled.clamp_(-limit, limit).to(dtype)
    return Float8Tensor(data, scale.detach().to(torch.float32))


def quantize_with_current_scale(tensor: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> Float8Tensor:
    """Quantize with the scale computed from this tensor's own amax (per-tensor current scaling)."""
    return quantize(tensor, dtype, scale_from_amax(amax(tensor), dtype, margin))


def dequantize(fp8_tensor: Float8Tensor, dtype=torch.float32) -> torch.Tensor:
    return fp8_tensor.dequantize(dtype)


def fake_quantize(tensor: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """quantize then dequantize, in `tensor`'s dtype: the value an FP8 GEMM would see."""
    return quantize(tensor, dtype, scale).dequantize(tensor.dtype)


def as_uint8(data: torch.Tensor) -> torch.Tensor:
    """A float8 tensor viewed as bytes, for backends (gloo) whose collectives reject float8 dtypes."""
    return data.view(torch.uint8)

"""FP8 formats and recipe names.

A *format* names the float8 dtype of each direction of a GEMM: `e4m3` uses `float8_e4m3fn` everywhere;
`hybrid` uses e4m3 for the forward pass (activations, weights) and `float8_e5m2` for gradients, whose wider
exponent range matters more than mantissa bits. A *recipe* says how a tensor's scale is chosen (see scaling.py).
"""

import functools
from dataclasses import dataclass

import torch

FP8_FORMATS = ("e4m3", "hybrid")
TORCH_NATIVE_RECIPES = ("delayed", "tensorwise")
GPU_ONLY_RECIPES = ("mxfp8", "blockwise")
FP8_RECIPES = TORCH_NATIVE_RECIPES + GPU_ONLY_RECIPES
AMAX_COMPUTE_ALGOS = ("most_recent", "max")


@dataclass(frozen=True)
class Fp8Format:
    """The float8 dtypes of one format: `forward_dtype` for activations and weights, `backward_dtype` for
    gradients."""

    name: str
    forward_dtype: torch.dtype
    backward_dtype: torch.dtype


_FORMATS = {
    "e4m3": Fp8Format("e4m3", torch.float8_e4m3fn, torch.float8_e4m3fn),
    "hybrid": Fp8Format("hybrid", torch.float8_e4m3fn, torch.float8_e5m2),
}


def get_fp8_format(name: str) -> Fp8Format:
    if name not in _FORMATS:
        raise ValueError(f"--fp8-format must be one of {FP8_FORMATS}, got {name!r}")
    return _FORMATS[name]


@functools.cache
def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of a float8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def is_fp8_dtype(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


# Rows an FP8 GEMM operand is padded to a multiple of: 16 for the per-tensor recipes' kernels, 32 for MXFP8's
# blocks of 32 elements sharing one scale.
_ALIGN_SIZES = {"delayed": 16, "tensorwise": 16, "blockwise": 16, "mxfp8": 32}


def get_fp8_align_size(fp8_recipe) -> int:
    """The multiple FP8 GEMM dimensions are padded to under `fp8_recipe` (a `megatron.core.enums.Fp8Recipe`
    member or its name): 32 for `mxfp8`, 16 otherwise (e.g. tokens per expert, `--moe-router-padding-for-fp8`)."""
    name = str(fp8_recipe)
    if name not in _ALIGN_SIZES:
        raise ValueError(f"fp8_recipe (--fp8-recipe) must be one of {FP8_RECIPES}, got {fp8_recipe!r}")
    return _ALIGN_SIZES[name]

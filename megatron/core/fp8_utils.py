"""FP8 recipes, contexts and FP8 tensor helpers: the entry point users import.

Formats `e4m3` and `hybrid` (e4m3 forward, e5m2 gradients); recipes `delayed` (scale from an amax history)
and `tensorwise` (current per-tensor scaling) run on any device with torch's float8 dtypes, `mxfp8` and
`blockwise` only through Transformer Engine on GPUs. Layers run in FP8 inside `get_fp8_context(config,
layer_no)`; a training loop calls `reduce_fp8_amaxes(model_chunks)` once per optimizer step, after forward and
backward (delayed-scaling amaxes, one collective; the step's FP8 weight caches). The implementation lives in
`megatron.core.fp8`, one file per concern.

`Fp8Recipe` is the enum of recipe names (`megatron.core.enums.Fp8Recipe`, `Fp8Recipe.delayed`, ...), as upstream
exports it; `Fp8RecipeSettings` is one run's full set of FP8 flags (format, recipe, margin, history).
"""

from megatron.core.enums import Fp8Recipe
from megatron.core.fp8.context import Fp8Region, active_fp8_region, get_fp8_context, is_first_last_bf16_layer
from megatron.core.fp8.formats import (
    AMAX_COMPUTE_ALGOS,
    FP8_FORMATS,
    FP8_RECIPES,
    GPU_ONLY_RECIPES,
    TORCH_NATIVE_RECIPES,
    Fp8Format,
    fp8_max,
    get_fp8_align_size,
    get_fp8_format,
    is_fp8_dtype,
)
from megatron.core.fp8.inference import prepare_model_for_fp8_inference
from megatron.core.fp8.linear import (fp8_gemm, fp8_linear, force_fp8_gemm_emulation, force_fp8_scaled_mm,
                                      gemm_plan, scaled_mm_supported)
from megatron.core.fp8.params import correct_amax_history_if_needed, quantize_param_shard
from megatron.core.fp8.recipe import Fp8RecipeSettings
from megatron.core.fp8.scaling import (LinearScaling, ScalingState, amax_reduction_groups, reduce_and_record_amaxes,
                                       reduce_fp8_amaxes)
from megatron.core.fp8.tensor import (
    ScaledFloat8,
    amax,
    dequantize,
    dequantize_fp8_tensor,
    is_float8tensor,
    modify_underlying_storage,
    quantize,
    quantize_by_amax,
    quantize_with_current_scale,
    scale_from_amax,
)

__all__ = [
    "AMAX_COMPUTE_ALGOS",
    "FP8_FORMATS",
    "FP8_RECIPES",
    "GPU_ONLY_RECIPES",
    "TORCH_NATIVE_RECIPES",
    "ScaledFloat8",
    "Fp8Format",
    "Fp8Recipe",
    "Fp8RecipeSettings",
    "Fp8Region",
    "LinearScaling",
    "ScalingState",
    "active_fp8_region",
    "amax",
    "amax_reduction_groups",
    "correct_amax_history_if_needed",
    "dequantize",
    "dequantize_fp8_tensor",
    "force_fp8_gemm_emulation",
    "force_fp8_scaled_mm",
    "fp8_gemm",
    "fp8_linear",
    "fp8_max",
    "gemm_plan",
    "get_fp8_align_size",
    "get_fp8_context",
    "get_fp8_format",
    "is_first_last_bf16_layer",
    "is_float8tensor",
    "is_fp8_dtype",
    "modify_underlying_storage",
    "prepare_model_for_fp8_inference",
    "quantize",
    "quantize_by_amax",
    "quantize_param_shard",
    "quantize_with_current_scale",
    "reduce_and_record_amaxes",
    "reduce_fp8_amaxes",
    "scale_from_amax",
    "scaled_mm_supported",
]

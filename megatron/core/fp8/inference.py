"""`prepare_model_for_fp8_inference(model)`: FP8 inference with inputs of any length.

FP8 GEMM kernels take dimensions that are multiples of 16. The torch-native FP8 linear (`--transformer-impl
local`) already zero-pads each GEMM that needs it and slices the result back (`megatron.core.fp8.linear.
gemm_plan`), so a model of those layers runs any sequence length in FP8 as it is. Padding the inputs of
Transformer Engine's layers is not provided here.
"""

import torch


def prepare_model_for_fp8_inference(model: torch.nn.Module) -> torch.nn.Module:
    """`model`, ready for FP8 inference with inputs of any length: returned as it is under `--transformer-impl
    local`. Raises NotImplementedError for a model with FP8 Transformer Engine layers, whose inputs would need
    padding to multiples of 16 that this codebase does not add."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"prepare_model_for_fp8_inference: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "fp8", None) and getattr(config, "transformer_impl", "local") == "transformer_engine":
            raise NotImplementedError(
                "prepare_model_for_fp8_inference: padding the inputs of Transformer Engine's FP8 layers is not "
                "provided here; build the model with --transformer-impl local, whose FP8 GEMMs pad themselves, "
                "or pad the sequence to a multiple of 16 before calling it")
    return model

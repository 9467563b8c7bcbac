"""Where FP8 is in effect: `get_fp8_context(config, layer_no)` and the torch-native FP8 region.

Linear layers quantize their GEMMs only inside an FP8 region. The transformer block opens one region per
layer, so `--first-last-layers-bf16` can keep the first and last layers in the parameters' precision by simply
not opening it there; the output layer and the embedding are never inside one. Under delayed scaling the amaxes
the layers record stay pending on the device; the training step reduces all of them across the ranks sharing the
layers in one collective per optimizer step (`megatron.core.fp8.scaling.reduce_fp8_amaxes`) and pushes them into
the histories that the next scales are read from.

The region itself lives in `megatron.core.fp8.region`, which imports nothing of the Transformer Engine backend:
the tensor-parallel layers import it, and the backend imports those layers.
"""

import contextlib

from megatron.core.fp8.recipe import Fp8RecipeSettings
from megatron.core.fp8.region import Fp8Region, active_fp8_region

__all__ = ["Fp8Region", "active_fp8_region", "get_fp8_context", "is_first_last_bf16_layer"]


def is_first_last_bf16_layer(config, layer_no: int) -> bool:
    """True when global layer `layer_no` (0-based) stays out of FP8 under `--first-last-layers-bf16`."""
    if not getattr(config, "first_last_layers_bf16", False) or layer_no < 0:
        return False
    return (
        layer_no < config.num_layers_at_start_in_bf16
        or layer_no >= config.num_layers - config.num_layers_at_end_in_bf16
    )


def get_fp8_context(config, layer_no: int = -1, is_init: bool = False):
    """The context to run layer `layer_no` (0-based, global; -1: not a specific layer) of a model in.

    A null context when FP8 is off or the layer stays in high precision; Transformer Engine's autocast with
    `--transformer-impl transformer_engine`; otherwise a torch-native `Fp8Region`. `is_init` asks for the
    context to build a model in: a null context under both implementations, because weights are built in high
    precision and `--fp8-param-gather` keeps their FP8 bytes in the gather buffers (`megatron.core.fp8.params`,
    `megatron.core.fp8.fsdp_gather`), not in TE's own FP8 parameters.
    """
    if is_init or not getattr(config, "fp8", None) or is_first_last_bf16_layer(config, layer_no):
        return contextlib.nullcontext()
    if getattr(config, "transformer_impl", "local") == "transformer_engine":
        from megatron.core.extensions.transformer_engine import te_fp8_context

        return te_fp8_context(config)
    return Fp8Region(Fp8RecipeSettings.from_config(config))

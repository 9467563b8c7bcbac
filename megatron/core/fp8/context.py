"""Where FP8 is in effect: `get_fp8_context(config, layer_no)` and the torch-native FP8 region.

Linear layers quantize their GEMMs only inside an FP8 region. The transformer block opens one region per
layer, so `--first-last-layers-bf16` can keep the first and last layers in the parameters' precision by simply
not opening it there; the output layer and the embedding are never inside one. When a torch-native region
ends under delayed scaling, the amaxes its layers recorded (forward amaxes of this pass and gradient amaxes of
the previous backward) are reduced across the ranks sharing those layers in one collective, and pushed into
the histories that the next scales are read from.
"""

import contextlib
import threading

from megatron.core.fp8.recipe import Fp8Recipe
from megatron.core.fp8.scaling import amax_reduction_groups, reduce_and_record_amaxes

_LOCAL = threading.local()


def _region_stack():
    if not hasattr(_LOCAL, "regions"):
        _LOCAL.regions = []
    return _LOCAL.regions


class Fp8Region:
    """A torch-native FP8 region: linear layers run inside it quantize with `recipe`."""

    def __init__(self, recipe: Fp8Recipe, reduction_groups=None):
        self.recipe = recipe
        self.reduction_groups = reduction_groups
        self._used_states = []
        self._used_ids = set()

    def use(self, linear_scaling):
        """Called by a layer that quantizes inside this region (its amaxes are reduced when it ends)."""
        if id(linear_scaling) not in self._used_ids:
            self._used_ids.add(id(linear_scaling))
            self._used_states.extend(linear_scaling.states())

    def __enter__(self):
        _region_stack().append(self)
        return self

    def __exit__(self, *exc):
        _region_stack().pop()
        if exc[0] is None and self.recipe.is_delayed:
            groups = amax_reduction_groups() if self.reduction_groups is None else self.reduction_groups
            reduce_and_record_amaxes(self._used_states, groups)
        return False


def active_fp8_region():
    """The innermost torch-native FP8 region, or None when FP8 is not in effect."""
    stack = _region_stack()
    return stack[-1] if stack else None


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
    return Fp8Region(Fp8Recipe.from_config(config))

"""FP8 state of the tensor-parallel linear layers: scaling states, the step's FP8 weight, amax-history buffers.

Inside an FP8 region (`megatron.core.fp8_utils.get_fp8_context`) the linear layers run their GEMMs in FP8 through
the torch-native backend (`megatron.core.fp8.linear`); a weight that carries an FP8 copy (`weight.fp8_weight`,
installed by `--fp8-param-gather`) is used as it is, else the layer quantizes its weight once per optimizer step.
Under delayed scaling each linear layer of a transformer layer keeps its amax histories in buffers
(`fp8_amax_history`, `fp8_amax_recorded_count`), so they are saved and restored with the model; a state dict
without them (a run without delayed FP8 scaling) loads, and the histories start empty; histories saved with
another `--fp8-amax-history-len` load fitted to this run's (`megatron.core.fp8.checkpoint`); layers that never run
in FP8 (the output layer) have none and ignore them.
"""

import functools

import torch

from megatron.core.fp8.checkpoint import (
    FP8_HISTORY_BUFFERS,
    fit_loaded_amax_history,
    start_missing_fp8_histories_empty,
)
from megatron.core.fp8.linear import fp8_linear, scaled_mm_in_use
from megatron.core.fp8.recipe import Fp8RecipeSettings
from megatron.core.fp8.region import active_fp8_region
from megatron.core.fp8.scaling import LinearScaling
from megatron.core.tensor_parallel.linear_function import linear_with_grad_accumulation
from megatron.core.tensor_parallel.partitioned_parameters import parameter_device


def _uses_torch_native_delayed_fp8(config):
    return (
        getattr(config, "fp8", None) is not None
        and getattr(config, "fp8_recipe", None) == "delayed"
        and getattr(config, "transformer_impl", "local") == "local"
    )


def _fp8_linear_load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
    """Loading resets the layer's FP8 state kept off the state dict (scaling states, the step's weight cache); a
    layer without amax-history buffers ignores the ones a state dict has (older checkpoints gave them to every
    linear layer, the output layer too); one with them starts them empty when the state dict has none, and fits
    them to its history length when they were saved with another `--fp8-amax-history-len`."""
    module._fp8_scaling = None
    module._fp8_weight_cache = None
    if getattr(module, "fp8_amax_history", None) is None:
        for name in FP8_HISTORY_BUFFERS:
            state_dict.pop(prefix + name, None)
        return
    fit_loaded_amax_history(module, state_dict, prefix)
    start_missing_fp8_histories_empty(module, state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)


class _Fp8LinearMixin:
    """FP8 state of a tensor-parallel linear layer: its scaling states, the step's FP8 weight and the GEMM dispatch.

    Under delayed scaling (`--transformer-impl local`) a layer that can run inside an FP8 region (one of a
    transformer layer, built through `megatron.core.extensions.transformer_engine.layer_classes`) keeps its amax
    histories in buffers (`register_fp8_histories`); others (the output layer) have none, as they never quantize.

    The FP8 weight is cached for the optimizer step once the training loop manages the layer (it calls
    `fp8_step_states()` every step, through `megatron.core.fp8.scaling.reduce_fp8_amaxes`, which starts the
    cache anew): later microbatches reuse it while the weight's version counter and storage are unchanged.
    """

    fp8_parallel_mode = "none"

    def _init_fp8(self, config):
        self._fp8_scaling = None
        self._fp8_weight_cache = None
        self._fp8_step_managed = False
        self._fp8_keep_transpose = bool(getattr(config, "keep_fp8_transpose_cache", False))
        self._fp8_history_recipe = (Fp8RecipeSettings.from_config(config) if _uses_torch_native_delayed_fp8(config)
                                    else None)
        self._register_load_state_dict_pre_hook(_fp8_linear_load_pre_hook, with_module=True)

    @functools.cached_property
    def _fp8_label(self):
        return f"{type(self).__name__}({self.input_size}->{self.output_size})"

    def register_fp8_histories(self):
        """Give the layer its delayed-scaling amax-history buffers (`fp8_amax_history` `[3, history length]` and
        `fp8_amax_recorded_count` `[3]`, on the parameters' device); nothing without delayed scaling. Returns
        the layer."""
        recipe = self._fp8_history_recipe
        if recipe is None or getattr(self, "fp8_amax_history", None) is not None:
            return self
        device = self.weight.device if self.weight is not None else parameter_device(self.config)
        self.register_buffer("fp8_amax_history",
                             torch.zeros(3, recipe.amax_history_len, dtype=torch.float32, device=device))
        self.register_buffer("fp8_amax_recorded_count", torch.zeros(3, dtype=torch.int64, device=device))
        return self

    def fp8_scaling(self, recipe):
        """The layer's `LinearScaling` for `recipe` (rebuilt when the recipe or the history buffers change)."""
        history = self._buffers.get("fp8_amax_history")
        counts = self._buffers.get("fp8_amax_recorded_count")
        if history is not None and history.shape[1] != recipe.amax_history_len:
            history = counts = None
        scaling = self._fp8_scaling
        if (scaling is None or (scaling.recipe is not recipe and scaling.recipe != recipe)
                or getattr(scaling, "storage", None) is not history):
            scaling = LinearScaling(recipe, self.fp8_parallel_mode, history_storage=history, count_storage=counts)
            scaling.storage = history
            self._fp8_scaling = scaling
        return scaling

    def fp8_step_states(self):
        """Called once per optimizer step (`reduce_fp8_amaxes`): start the FP8 weight cache anew and return the
        delayed-scaling states whose pending amaxes are reduced now (the same number on every rank)."""
        self._fp8_step_managed = True
        self._fp8_weight_cache = None
        if self._fp8_history_recipe is not None and getattr(self, "fp8_amax_history", None) is not None:
            return self.fp8_scaling(self._fp8_history_recipe).states()
        scaling = self._fp8_scaling
        return scaling.states() if scaling is not None and scaling.recipe.is_delayed else ()

    def _fp8_weight(self, weight, scaling):
        """The weight in FP8: the gathered one (`--fp8-param-gather`), the step's cached one, or quantized now."""
        gathered = weight.__dict__.get("fp8_weight")  # a missing attribute would cost an exception per call
        if gathered is not None:
            return gathered
        with_transpose = self._fp8_keep_transpose and scaled_mm_in_use(weight.device.type)
        if not self._fp8_step_managed:
            return scaling.weight.quantize(weight, with_transpose=with_transpose)
        # A cache miss quantizes again, which reduces the amax over the tensor-parallel group under tensorwise
        # scaling: there the key leaves out the storage address, which ranks need not share.
        collective = not scaling.recipe.is_delayed and scaling.weight.sharded_over_tensor_parallel
        key = (weight._version, None if collective else weight.data_ptr(), id(scaling), scaling.weight.generation,
               with_transpose)
        cached = self._fp8_weight_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        fp8_weight = scaling.weight.quantize(weight, with_transpose=with_transpose)
        self._fp8_weight_cache = (key, fp8_weight)
        return fp8_weight

    def _matmul(self, input_, weight, bias):
        region = active_fp8_region()
        if region is None:
            return linear_with_grad_accumulation(input_, weight, bias, self.gradient_accumulation_fusion)
        scaling = self.fp8_scaling(region.recipe)
        return fp8_linear(
            input_,
            weight,
            bias,
            scaling,
            weight_fp8=self._fp8_weight(weight, scaling),
            accumulate_into_main_grad=self.gradient_accumulation_fusion and torch.is_grad_enabled(),
            label=self._fp8_label,
        )

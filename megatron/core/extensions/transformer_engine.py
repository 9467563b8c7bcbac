"""Transformer Engine backend (`--transformer-impl transformer_engine`): TE's linear layers and FP8 autocast.

Everything here needs transformer-engine, which needs CUDA; the module imports it only when a TE layer or
context is asked for, and `require_transformer_engine()` fails with a message naming the flag otherwise.
The wrappers take the constructor arguments of `ColumnParallelLinear` / `RowParallelLinear` and return
`(output, bias)` the same way, so attention and MLP build either kind through `layer_classes(config)`.
Initialisation differs from the local layers: TE initialises each rank's partition directly.
"""

import functools

from megatron.core.optional_deps import HAVE_TE


def require_transformer_engine():
    if not HAVE_TE:
        raise RuntimeError(
            "--transformer-impl transformer_engine needs transformer-engine, which is not importable here (it "
            "needs CUDA): install it on a GPU machine (pip install '.[te]') or use --transformer-impl local"
        )


def te_recipe(config):
    """The Transformer Engine recipe for the config's `fp8` / `fp8_recipe` fields."""
    require_transformer_engine()
    from transformer_engine.common import recipe as te_recipes

    fp8_format = te_recipes.Format.HYBRID if config.fp8 == "hybrid" else te_recipes.Format.E4M3
    if config.fp8_recipe == "delayed":
        return te_recipes.DelayedScaling(
            fp8_format=fp8_format,
            margin=config.fp8_margin,
            amax_history_len=config.fp8_amax_history_len,
            amax_compute_algo=config.fp8_amax_compute_algo,
        )
    if config.fp8_recipe == "tensorwise":
        return te_recipes.Float8CurrentScaling(fp8_format=fp8_format)
    if config.fp8_recipe == "mxfp8":
        return te_recipes.MXFP8BlockScaling(fp8_format=fp8_format)
    if config.fp8_recipe == "blockwise":
        return te_recipes.Float8BlockScaling(fp8_format=fp8_format)
    raise ValueError(f"--fp8-recipe {config.fp8_recipe!r} has no Transformer Engine recipe")


def te_fp8_context(config, is_init=False):
    """TE's FP8 autocast for a forward pass, or (`is_init`) its FP8 model-init context for `--fp8-param-gather`."""
    require_transformer_engine()
    import transformer_engine.pytorch as te

    from megatron.core.fp8.scaling import amax_reduction_groups

    if is_init:
        return te.fp8_model_init(enabled=bool(config.fp8_param))
    groups = amax_reduction_groups()
    # TE reduces amaxes over one group; the data-parallel one covers the replicas of this rank's shard.
    return te.fp8_autocast(enabled=True, fp8_recipe=te_recipe(config), fp8_group=groups[-1] if groups else None)


@functools.cache
def _te_linear_classes():
    require_transformer_engine()
    import transformer_engine.pytorch as te

    from megatron.core import parallel_state
    from megatron.core.device_utils import get_current_device
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    def te_linear_kwargs(config, init_method, bias, skip_bias_add):
        return dict(
            sequence_parallel=config.sequence_parallel,
            fuse_wgrad_accumulation=config.gradient_accumulation_fusion,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            tp_size=config.tensor_model_parallel_size,
            get_rng_state_tracker=get_cuda_rng_tracker,
            init_method=init_method,
            bias=bias,
            return_bias=skip_bias_add,
            params_dtype=config.params_dtype,
            device=get_current_device(),
        )

    class _ReturnsOutputAndBias:
        def forward(self, input_):
            output = super().forward(input_)
            return output if self.skip_bias_add else (output, None)

    class TEColumnParallelLinear(_ReturnsOutputAndBias, te.Linear):
        """TE's column-parallel Linear with `ColumnParallelLinear`'s constructor (no gather_output)."""

        def __init__(self, input_size, output_size, *, config, init_method, bias=True, gather_output=False,
                     stride=1, skip_bias_add=False, skip_weight_param_allocation=False, is_expert=False,
                     tp_comm_buffer_name=None):
            if gather_output or skip_weight_param_allocation:
                raise ValueError("TEColumnParallelLinear supports neither gather_output nor a weight given at forward")
            self.skip_bias_add = skip_bias_add
            super().__init__(input_size, output_size, parallel_mode="column",
                             **te_linear_kwargs(config, init_method, bias, skip_bias_add))

    class TERowParallelLinear(_ReturnsOutputAndBias, te.Linear):
        """TE's row-parallel Linear with `RowParallelLinear`'s constructor (input already split)."""

        def __init__(self, input_size, output_size, *, config, init_method, bias=True, input_is_parallel=True,
                     stride=1, skip_bias_add=False, is_expert=False, tp_comm_buffer_name=None):
            if not input_is_parallel:
                raise ValueError("TERowParallelLinear needs input_is_parallel=True")
            self.skip_bias_add = skip_bias_add
            super().__init__(input_size, output_size, parallel_mode="row",
                             **te_linear_kwargs(config, init_method, bias, skip_bias_add))

    class TELayerNormColumnParallelLinear(_ReturnsOutputAndBias, te.LayerNormLinear):
        """TE's fused norm + column-parallel Linear (the norm of `config.normalization`)."""

        def __init__(self, input_size, output_size, *, config, init_method, bias=True, gather_output=False,
                     stride=1, skip_bias_add=False, is_expert=False, tp_comm_buffer_name=None):
            if gather_output:
                raise ValueError("TELayerNormColumnParallelLinear does not support gather_output")
            self.skip_bias_add = skip_bias_add
            super().__init__(input_size, output_size, eps=config.layernorm_epsilon,
                             normalization=config.normalization, parallel_mode="column",
                             **te_linear_kwargs(config, init_method, bias, skip_bias_add))

    return TEColumnParallelLinear, TERowParallelLinear, TELayerNormColumnParallelLinear


def te_linear_classes():
    """(TEColumnParallelLinear, TERowParallelLinear, TELayerNormColumnParallelLinear)."""
    return _te_linear_classes()


def layer_classes(config):
    """(column-parallel linear class, row-parallel linear class) for `config.transformer_impl`."""
    if getattr(config, "transformer_impl", "local") == "transformer_engine":
        column, row, _ = te_linear_classes()
        return column, row
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return ColumnParallelLinear, RowParallelLinear

"""Transformer Engine backend (`--transformer-impl transformer_engine`): TE's linear layers and FP8 autocast.

Everything here needs transformer-engine, which needs CUDA; the module imports it only when a TE layer or
context is asked for, and `require_transformer_engine()` fails with a message naming the flag otherwise.
The wrappers take the constructor arguments of `ColumnParallelLinear` / `RowParallelLinear` and return
`(output, bias)` the same way, so attention and MLP build either kind through `layer_classes(config)`; under TE
the QKV projection and fc1 are TE's fused LayerNorm-linear (`fused_norm_linear_class`), which applies the
layer's input / pre-MLP norm inside its kernel, as Megatron's TE layer spec does.

Checkpoints: a TE model has the local implementation's parameter and state-dict names. The fused linear uses
the parameters of the layer's own norm module (`BorrowsNormParameters`) instead of registering
`layer_norm_weight` / `layer_norm_bias` itself, and TE's `_extra_state` is left out of state dicts
(`OmitsTransformerEngineExtraState`), so a checkpoint written under either implementation loads into the other.
Initialisation differs from the local layers: TE initialises each rank's partition directly.
With `--fp8-param-gather` TE layers compute with high-precision weights dequantized from the FP8 bytes that
were all-gathered (see `megatron.core.fp8.params`), which TE's autocast quantizes again.
"""

import functools

import torch

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
            # (fprop, dgrad, wgrad) run in higher precision: --no-fp8-wgrad, as upstream.
            override_linear_precision=(False, False, not getattr(config, "fp8_wgrad", True)),
        )
    if not getattr(config, "fp8_wgrad", True):
        raise ValueError(f"--no-fp8-wgrad with --transformer-impl transformer_engine needs --fp8-recipe delayed (the "
                         f"Transformer Engine recipe that takes a wgrad precision override), got "
                         f"{config.fp8_recipe}; use --transformer-impl local, which honours it with delayed and "
                         "tensorwise")
    if config.fp8_recipe == "tensorwise":
        return te_recipes.Float8CurrentScaling(fp8_format=fp8_format)
    if config.fp8_recipe == "mxfp8":
        return te_recipes.MXFP8BlockScaling(fp8_format=fp8_format)
    if config.fp8_recipe == "blockwise":
        return te_recipes.Float8BlockScaling(fp8_format=fp8_format)
    raise ValueError(f"--fp8-recipe {config.fp8_recipe!r} has no Transformer Engine recipe")


def te_fp8_context(config):
    """TE's FP8 autocast for a forward pass, reducing amaxes over the pipeline stage's amax-reduction group (its
    TP x DP x CP ranks: the group the torch-native delayed recipe reduces over too), so the tensor-parallel
    shards and the replicas of a weight agree on its scale."""
    require_transformer_engine()
    import transformer_engine.pytorch as te

    from megatron.core.fp8.scaling import amax_reduction_group

    group = amax_reduction_group(getattr(config, "tp_only_amax_red", False))
    if hasattr(te, "autocast"):  # TE >= 2.8; fp8_autocast is its deprecated spelling
        return te.autocast(enabled=True, recipe=te_recipe(config), amax_reduction_group=group)
    return te.fp8_autocast(enabled=True, fp8_recipe=te_recipe(config), fp8_group=group)


# ---- checkpoint names -----------------------------------------------------------------------------------------


class _BorrowedNormParameter:
    """`layer_norm_weight` / `layer_norm_bias` of a TE LayerNormLinear whose norm parameters are borrowed.

    A non-data descriptor: until `borrow_norm_parameters` runs (during TE's own constructor) it steps aside
    (AttributeError sends the lookup to `nn.Module.__getattr__`, i.e. to TE's registered parameter, and plain
    assignments land in the instance dict); afterwards it returns the borrowed norm's `weight` / `bias`.
    """

    def __init__(self, norm_attribute):
        self.norm_attribute = norm_attribute

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, module, owner=None):
        if module is None:
            return self
        norm = module.__dict__.get("_borrowed_norm")
        if norm is None:
            raise AttributeError(self.name)
        return getattr(norm, self.norm_attribute, None)


class BorrowsNormParameters:
    """Mixin for TE's LayerNormLinear: its norm weight and bias are the parameters of a norm module that the
    transformer layer owns (`input_layernorm` / `pre_mlp_layernorm`), not parameters of its own.

    So a TE model has exactly the parameter names of the local implementation, which applies that norm itself
    (`...input_layernorm.weight`, not `...self_attention.linear_qkv.layer_norm_weight`): parameter lists,
    optimizer state and checkpoints are the same under both implementations, and a checkpoint of either
    loads into the other. TE reads the norm parameters as `self.layer_norm_weight` / `self.layer_norm_bias`
    when it runs, which the descriptors answer with the borrowed module's live parameters (so a wrapper that
    replaces the norm's parameters is followed).
    """

    layer_norm_weight = _BorrowedNormParameter("weight")
    layer_norm_bias = _BorrowedNormParameter("bias")

    def borrow_norm_parameters(self, norm):
        """Use `norm`'s weight (and bias) from now on; drop the norm parameters TE built for itself."""
        for name in ("layer_norm_weight", "layer_norm_bias"):
            self._parameters.pop(name, None)
            self.__dict__.pop(name, None)  # TE assigns `layer_norm_bias = None` for RMSNorm
        # Not a registered submodule: the layer owns it (and saves it under its own name).
        object.__setattr__(self, "_borrowed_norm", norm)


class OmitsTransformerEngineExtraState:
    """Mixin for TE modules: their `_extra_state` (TE's FP8 scaling metadata, a pickled byte tensor whose size
    varies with the recipe and the run) is left out of state dicts, and a state dict without it loads.

    The local implementation has no such key, so leaving it out keeps checkpoints interchangeable between the
    implementations. TE's delayed-scaling amax histories therefore start anew after a load (the first steps
    scale by the current amaxes), as a local-implementation run does when it loads a checkpoint without
    histories (`megatron.core.fp8.checkpoint`).
    """

    EXTRA_STATE = "_extra_state"

    def omit_extra_state_from_state_dicts(self):
        self.register_state_dict_post_hook(_drop_extra_state)
        self.register_load_state_dict_pre_hook(_accept_missing_extra_state)


def _drop_extra_state(module, state_dict, prefix, local_metadata):
    state_dict.pop(prefix + OmitsTransformerEngineExtraState.EXTRA_STATE, None)


def _accept_missing_extra_state(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                error_msgs):
    # TE's set_extra_state takes an empty tensor as "nothing saved".
    state_dict.setdefault(prefix + OmitsTransformerEngineExtraState.EXTRA_STATE, torch.empty(0, dtype=torch.uint8))


# ---- the wrapped layers ---------------------------------------------------------------------------------------


def _leave_uninitialized(weight):
    """The init method of `perform_initialization=False`: the weight keeps what its allocation held."""


def make_te_linear_classes(linear_base, layer_norm_linear_base):
    """The wrappers around TE's `Linear` and `LayerNormLinear` (`linear_base`, `layer_norm_linear_base`):
    (TEColumnParallelLinear, TERowParallelLinear, TELayerNormColumnParallelLinear).

    The bases are parameters so the wrappers' own code (constructor mapping, return convention, borrowed norm
    parameters, omitted extra state) can be exercised against torch stand-ins on machines without TE.
    """
    from megatron.core import parallel_state
    from megatron.core.device_utils import get_current_device
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    def te_linear_kwargs(config, init_method, bias, skip_bias_add):
        tp_group = None
        if parallel_state.model_parallel_is_initialized():
            tp_group = parallel_state.get_tensor_model_parallel_group()
        return dict(
            sequence_parallel=config.sequence_parallel,
            fuse_wgrad_accumulation=config.gradient_accumulation_fusion,
            tp_group=tp_group,
            tp_size=config.tensor_model_parallel_size,
            get_rng_state_tracker=get_cuda_rng_tracker,
            # --no-initialization: TE allocates the weight and calls init_method on it; leave it as allocated.
            init_method=init_method if config.perform_initialization else _leave_uninitialized,
            bias=bias,
            return_bias=skip_bias_add,
            params_dtype=config.params_dtype,
            device=get_current_device(),
        )

    class _ReturnsOutputAndBias(OmitsTransformerEngineExtraState):
        def forward(self, input_):
            output = super().forward(input_)
            return output if self.skip_bias_add else (output, None)

    class TEColumnParallelLinear(_ReturnsOutputAndBias, linear_base):
        """TE's column-parallel Linear with `ColumnParallelLinear`'s constructor (no gather_output)."""

        def __init__(self, input_size, output_size, *, config, init_method, bias=True, gather_output=False,
                     stride=1, skip_bias_add=False, skip_weight_param_allocation=False, is_expert=False,
                     tp_comm_buffer_name=None):
            if gather_output or skip_weight_param_allocation:
                raise ValueError("TEColumnParallelLinear supports neither gather_output nor a weight given at forward")
            self.skip_bias_add = skip_bias_add
            super().__init__(input_size, output_size, parallel_mode="column",
                             **te_linear_kwargs(config, init_method, bias, skip_bias_add))
            self.omit_extra_state_from_state_dicts()

    class TERowParallelLinear(_ReturnsOutputAndBias, linear_base):
        """TE's row-parallel Linear with `RowParallelLinear`'s constructor (input already split)."""

        def __init__(self, input_size, output_size, *, config, init_method, bias=True, input_is_parallel=True,
                     stride=1, skip_bias_add=False, is_expert=False, tp_comm_buffer_name=None):
            if not input_is_parallel:
                raise ValueError("TERowParallelLinear needs input_is_parallel=True")
            self.skip_bias_add = skip_bias_add
            super().__init__(input_size, output_size, parallel_mode="row",
                             **te_linear_kwargs(config, init_method, bias, skip_bias_add))
            self.omit_extra_state_from_state_dicts()

    class TELayerNormColumnParallelLinear(_ReturnsOutputAndBias, BorrowsNormParameters, layer_norm_linear_base):
        """TE's fused norm + column-parallel Linear: `norm` (the layer's norm module, built by `build_norm`
        from `config.normalization`) is applied inside TE's kernel with `norm`'s parameters."""

        def __init__(self, input_size, output_size, *, config, init_method, norm, bias=True, gather_output=False,
                     stride=1, skip_bias_add=False, is_expert=False, tp_comm_buffer_name=None):
            if gather_output:
                raise ValueError("TELayerNormColumnParallelLinear does not support gather_output")
            self.skip_bias_add = skip_bias_add
            super().__init__(input_size, output_size, eps=config.layernorm_epsilon,
                             normalization=config.normalization, parallel_mode="column",
                             zero_centered_gamma=bool(config.layernorm_zero_centered_gamma),
                             **te_linear_kwargs(config, init_method, bias, skip_bias_add))
            self.borrow_norm_parameters(norm)
            self.omit_extra_state_from_state_dicts()

    return TEColumnParallelLinear, TERowParallelLinear, TELayerNormColumnParallelLinear


@functools.cache
def _te_linear_classes():
    require_transformer_engine()
    import transformer_engine.pytorch as te

    return make_te_linear_classes(te.Linear, te.LayerNormLinear)


def te_linear_classes():
    """(TEColumnParallelLinear, TERowParallelLinear, TELayerNormColumnParallelLinear)."""
    return _te_linear_classes()


def uses_transformer_engine(config) -> bool:
    return getattr(config, "transformer_impl", "local") == "transformer_engine"


def _fp8_region_layer(cls):
    """`cls`'s constructor for a linear layer of a transformer layer, which can run inside FP8 regions: the layer
    also gets its delayed-scaling amax-history buffers (`register_fp8_histories`)."""

    @functools.wraps(cls, updated=())
    def build(*args, **kwargs):
        return cls(*args, **kwargs).register_fp8_histories()

    return build


def layer_classes(config):
    """(column-parallel linear class, row-parallel linear class) for `config.transformer_impl`, to build the linear
    layers of transformer layers with. Under torch-native delayed FP8 scaling they are constructors of the local
    classes that also give each layer its amax-history buffers (layers built otherwise, such as the output
    layer, never run in an FP8 region and have none)."""
    if uses_transformer_engine(config):
        column, row, _ = te_linear_classes()
        return column, row
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      _uses_torch_native_delayed_fp8)

    if _uses_torch_native_delayed_fp8(config):
        return _fp8_region_layer(ColumnParallelLinear), _fp8_region_layer(RowParallelLinear)
    return ColumnParallelLinear, RowParallelLinear


def fused_norm_linear_class(config):
    """The class that applies a layer's norm inside its first linear (QKV, fc1), as Megatron's TE layer spec
    does, or None when the layer applies the norm itself (the local implementation)."""
    if uses_transformer_engine(config):
        return te_linear_classes()[2]
    return None


def fp8_linear_classes(config):
    """The linear-layer classes whose weights run in FP8 regions under `config.transformer_impl`."""
    if uses_transformer_engine(config):
        return te_linear_classes()
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return ColumnParallelLinear, RowParallelLinear


# ---- upstream's class names -------------------------------------------------------------------------------

# The wrapped layers, under the names upstream's layer specs (and tools such as modelopt) import.
_WRAPPED_LINEAR_NAMES = ("TEColumnParallelLinear", "TERowParallelLinear", "TELayerNormColumnParallelLinear")
# Upstream TE modules this code base does not build (the local layers and attention are used instead).
_NOT_BUILT_HERE = {
    "TELinear": "a duplicated (non-tensor-parallel) TE linear",
    "TENorm": "TE's LayerNorm / RMSNorm module (norms are built by megatron.core.transformer.norms.build_norm)",
    "TEDotProductAttention": "TE's fused attention (attention runs in megatron.core.transformer.attention)",
    "TEColumnParallelGroupedLinear": "TE's grouped GEMM for MoE experts",
    "TERowParallelGroupedLinear": "TE's grouped GEMM for MoE experts",
}


def _unavailable_class(name, message):
    def __init__(self, *args, **kwargs):
        raise RuntimeError(message)

    return type(name, (torch.nn.Module,), {"__init__": __init__, "__doc__": message, "__module__": __name__})


@functools.cache
def _named_class(name):
    if name in _WRAPPED_LINEAR_NAMES:
        if HAVE_TE:
            return te_linear_classes()[_WRAPPED_LINEAR_NAMES.index(name)]
        return _unavailable_class(
            name, f"{name} needs transformer-engine, which is not importable here (it needs CUDA): install it on a "
                  "GPU machine (pip install '.[te]') or build the model with --transformer-impl local")
    return _unavailable_class(
        name, f"{name} ({_NOT_BUILT_HERE[name]}) is not built in this code base, with or without "
              "transformer-engine: build the model with the local layers (--transformer-impl local)")


def __getattr__(name):
    """Upstream's TE class names: the wrapped TE layers when transformer-engine is importable; otherwise (and for
    the TE modules not built here) a class that exists, so isinstance checks and imports work, and whose
    constructor raises a RuntimeError saying what to do."""
    if name in _WRAPPED_LINEAR_NAMES or name in _NOT_BUILT_HERE:
        return _named_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

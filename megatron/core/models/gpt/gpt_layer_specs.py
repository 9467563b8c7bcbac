"""Upstream's GPT layer specs: `get_gpt_layer_local_spec`, `get_gpt_layer_with_transformer_engine_spec`,
`get_gpt_decoder_block_spec` and `get_gpt_mtp_block_spec`.

The layer specs are `ModuleSpec`s (of `TransformerLayer`, or of `MultiTokenPredictionBlock`) that record the
`TransformerConfig` fields their arguments mean (`transformer_impl`, `qk_layernorm`, `num_moe_experts`,
`mtp_num_layers`, ...); `get_gpt_decoder_block_spec` returns upstream's `TransformerBlockSubmodules`, one layer
spec per layer of the pipeline stage (dense or MoE by `moe_layer_freq`) and the final norm's class. The modules
are built from the config; `check_layer_spec(spec, config)` and `check_mtp_block_spec(spec, config)`, called by
`GPTModel` and `TransformerBlock`, refuse a spec that asks for something else and name the config field to set
instead, so an upstream script either builds the layers it asked for or stops.
"""

from megatron.core.transformer.moe.moe_config import moe_layer_pattern
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock
from megatron.core.transformer.norms import norm_class
from megatron.core.transformer.pipeline_stage import pipeline_stage_layer_range
from megatron.core.transformer.spec_utils import ModuleSpec, TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

# The fields of a MoE layer's spec that a dense layer's spec (num_experts=None) leaves at their defaults.
_MOE_SPEC_FIELDS = ("num_moe_experts", "moe_grouped_gemm")


def _layer_spec(transformer_impl, num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention, fp8,
                normalization, qk_l2_norm, use_kitchen):
    if use_kitchen:
        raise ValueError("use_kitchen (NVIDIA Kitchen quantized layers) is not available: drop it")
    fields = {"transformer_impl": transformer_impl, "num_moe_experts": num_experts,
              "qk_layernorm": bool(qk_layernorm), "multi_latent_attention": bool(multi_latent_attention),
              "qk_l2_norm": bool(qk_l2_norm)}
    if num_experts is not None:
        fields["moe_grouped_gemm"] = bool(moe_grouped_gemm)
    if normalization is not None:
        fields["normalization"] = normalization
    if fp8 is not None:
        # Upstream's deprecated argument (older scripts pass args.fp8): FP8 comes from the config, which must agree.
        fields["fp8"] = fp8
    return ModuleSpec(module=TransformerLayer, config_fields=fields)


def get_gpt_layer_local_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False,
                             multi_latent_attention=False, fp8=None, moe_use_legacy_grouped_gemm=False,
                             normalization=None, qk_l2_norm=False, use_kitchen=False):
    """The torch-native layer (`--transformer-impl local`)."""
    return _layer_spec("local", num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention, fp8,
                       normalization, qk_l2_norm, use_kitchen)


def get_gpt_layer_with_transformer_engine_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False,
                                               multi_latent_attention=False, fp8=None,
                                               moe_use_legacy_grouped_gemm=False, qk_l2_norm=False,
                                               use_te_op_fuser=False, use_kitchen=False, use_te_activation_func=False,
                                               fallback_to_eager_attn=False):
    """The Transformer Engine layer (`--transformer-impl transformer_engine`). `use_te_activation_func` and
    `fallback_to_eager_attn` choose kernels that compute the same values; they are accepted and change nothing."""
    if use_te_op_fuser:
        raise ValueError("use_te_op_fuser is not available: drop it (the TE linears run unfused)")
    return _layer_spec("transformer_engine", num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention,
                       fp8, None, qk_l2_norm, use_kitchen)


def get_gpt_decoder_block_spec(config, use_transformer_engine, normalization=None, qk_l2_norm=False, vp_stage=None,
                               pp_rank=None):
    """Upstream's spec of the decoder of one pipeline stage, used for MoE models: a `TransformerBlockSubmodules`
    with one layer spec per layer the stage holds (model chunk `vp_stage` of pipeline rank `pp_rank`; None: the
    ones being built, as `TransformerBlock`), a MoE layer's where `moe_layer_freq` puts one, else a dense
    layer's, and `layer_norm`, the final norm's class. For `GPTModel(config, transformer_layer_spec=...)` or
    `TransformerBlock(config, spec)`, which build the layers from `config` and check each spec against them."""
    if use_transformer_engine:
        def layer_spec(num_experts):
            return get_gpt_layer_with_transformer_engine_spec(
                num_experts, config.moe_grouped_gemm, config.qk_layernorm, config.multi_latent_attention,
                qk_l2_norm=qk_l2_norm)
    else:
        def layer_spec(num_experts):
            return get_gpt_layer_local_spec(num_experts, config.moe_grouped_gemm, config.qk_layernorm,
                                            config.multi_latent_attention, normalization=normalization,
                                            qk_l2_norm=qk_l2_norm)
    dense_spec, moe_spec = layer_spec(None), layer_spec(config.num_moe_experts)
    offset, count = pipeline_stage_layer_range(config, vp_stage, pp_rank)
    is_moe = moe_layer_pattern(config)[offset:offset + count]
    return TransformerBlockSubmodules(layer_specs=[moe_spec if moe else dense_spec for moe in is_moe],
                                      layer_norm=norm_class(config))


def get_gpt_mtp_block_spec(config, spec, use_transformer_engine, vp_stage=None, pp_rank=None):
    """The multi-token-prediction block of `config` (`--mtp-num-layers`), or None without one (as upstream).
    `spec` is the layer spec of the MTP depths (checked against the config); the depths run on the last pipeline
    stage, which `GPTModel` knows from `post_process`, so `vp_stage` and `pp_rank` are not needed to place them."""
    if not config.mtp_num_layers:
        return None
    if isinstance(spec, TransformerBlockSubmodules):
        if spec.layer_specs:  # as upstream, the depths follow the block's last layer (dense or MoE by the config)
            _check_config_fields("spec.layer_specs[-1]", _without_moe_fields(spec.layer_specs[-1]), config)
    elif isinstance(spec, ModuleSpec):
        check_layer_spec(spec, config)
    wanted_impl = "transformer_engine" if use_transformer_engine else "local"
    return ModuleSpec(module=MultiTokenPredictionBlock,
                      config_fields={"mtp_num_layers": config.mtp_num_layers, "transformer_impl": wanted_impl})


def check_mtp_block_spec(spec, config):
    """Raise unless `spec` (None: the config decides) describes the multi-token-prediction block `config`
    builds."""
    if spec is None:
        return
    if not isinstance(spec, ModuleSpec) or spec.module is not MultiTokenPredictionBlock:
        raise TypeError(f"mtp_block_spec must come from get_gpt_mtp_block_spec() (the MTP depths are built from "
                        f"TransformerConfig.mtp_num_layers), got {spec!r}")
    if not config.mtp_num_layers:
        raise ValueError("mtp_block_spec is given but TransformerConfig(mtp_num_layers) is unset: set "
                         "--mtp-num-layers, or pass mtp_block_spec=None")
    _check_config_fields("mtp_block_spec", spec.config_fields, config)


def _without_moe_fields(spec):
    return {name: value for name, value in spec.config_fields.items() if name not in _MOE_SPEC_FIELDS}


def _check_config_fields(argument, config_fields, config):
    for name, wanted in config_fields.items():
        have = getattr(config, name)
        if have != wanted:
            raise ValueError(f"{argument} asks for {name}={wanted!r} but the TransformerConfig has "
                             f"{name}={have!r}: the layers are built from the config, so set "
                             f"TransformerConfig({name}={wanted!r}) (or build the spec to match)"
                             + _without_transformer_engine_hint(name, wanted))


def _without_transformer_engine_hint(name, wanted):
    """Where Transformer Engine cannot be imported, the TE spec's only way forward is the local one."""
    from megatron.core import optional_deps

    if name != "transformer_impl" or wanted != "transformer_engine" or optional_deps.HAVE_TE:
        return ""
    return ("; transformer-engine is not importable here (it needs CUDA), so on this machine use "
            "get_gpt_layer_local_spec() instead of get_gpt_layer_with_transformer_engine_spec() (same layers and "
            "parameter names, torch-native)")


def check_layer_spec(spec, config, vp_stage=None):
    """Raise unless `spec` (None: no spec) describes the layers `config` builds: a layer spec, or a block spec
    (`TransformerBlockSubmodules`) of the pipeline stage holding model chunk `vp_stage`."""
    if spec is None:
        return
    if isinstance(spec, TransformerBlockSubmodules):
        _check_block_spec(spec, config, vp_stage)
        return
    _check_is_layer_spec("transformer_layer_spec", spec)
    _check_config_fields("transformer_layer_spec", spec.config_fields, config)


def _check_is_layer_spec(argument, spec):
    if not isinstance(spec, ModuleSpec) or spec.module is not TransformerLayer:
        raise TypeError(
            f"{argument} must come from get_gpt_layer_local_spec(), get_gpt_layer_with_transformer_engine_spec() "
            f"or get_gpt_decoder_block_spec() (layers are built from the TransformerConfig), got {spec!r}; "
            "GPTModel's arguments are (config, transformer_layer_spec, vocab_size, max_sequence_length) as upstream")


def _check_block_spec(spec, config, vp_stage):
    """One layer spec per layer of the stage, each dense or MoE as `moe_layer_freq` makes that layer."""
    if not isinstance(spec.layer_specs, (list, tuple)):
        raise TypeError(f"TransformerBlockSubmodules(layer_specs={spec.layer_specs!r}) must be a list of layer "
                        "specs, one per layer of this pipeline stage: build it with get_gpt_decoder_block_spec()")
    offset, count = pipeline_stage_layer_range(config, vp_stage)
    if len(spec.layer_specs) != count:
        raise ValueError(
            f"the block spec has {len(spec.layer_specs)} layer specs but this pipeline stage holds {count} layers "
            f"(layers {offset + 1}..{offset + count} of TransformerConfig(num_layers={config.num_layers})): build it "
            "with get_gpt_decoder_block_spec(config, ..., vp_stage=<the chunk being built>) for this stage")
    moe_layers = moe_layer_pattern(config)
    for index, layer_spec in enumerate(spec.layer_specs):
        argument = f"layer_specs[{index}]"
        _check_is_layer_spec(argument, layer_spec)
        layer_number = offset + index + 1
        asks_for_moe = layer_spec.config_fields.get("num_moe_experts") is not None
        if asks_for_moe != moe_layers[layer_number - 1]:
            asked, built = ("a MoE layer", "a dense layer") if asks_for_moe else ("a dense layer", "a MoE layer")
            raise ValueError(
                f"{argument} (layer {layer_number}) asks for {asked} but the TransformerConfig "
                f"(num_moe_experts={config.num_moe_experts}, moe_layer_freq={config.moe_layer_freq!r}) builds "
                f"{built} there: set --moe-layer-freq to match, or build the block spec with "
                "get_gpt_decoder_block_spec(config, ...)")
        fields = layer_spec.config_fields if asks_for_moe else _without_moe_fields(layer_spec)
        _check_config_fields(argument, fields, config)

"""Upstream's GPT layer specs: `get_gpt_layer_local_spec`, `get_gpt_layer_with_transformer_engine_spec`,
`get_gpt_decoder_block_spec` and `get_gpt_mtp_block_spec`.

Each returns a `ModuleSpec` (of `TransformerLayer`, or of `MultiTokenPredictionBlock`) that records the
`TransformerConfig` fields its arguments mean (`transformer_impl`, `qk_layernorm`, `num_moe_experts`,
`mtp_num_layers`, ...). The modules are built from the config; `check_layer_spec(spec, config)` and
`check_mtp_block_spec(spec, config)`, called by `GPTModel`, refuse a spec that asks for something else and name
the config field to set instead, so an upstream script either builds the layers it asked for or stops.
"""

from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer


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
    """Upstream's spec of the whole decoder, used for MoE models (dense and MoE layers by `--moe-layer-freq`).
    Every layer here is built from `config`, which already says which layers are MoE and which of them this
    pipeline stage holds, so this is the layer spec of `config` (local or Transformer Engine), for
    `GPTModel(config, transformer_layer_spec=...)`; `vp_stage` and `pp_rank` are not needed."""
    if use_transformer_engine:
        return get_gpt_layer_with_transformer_engine_spec(
            config.num_moe_experts, config.moe_grouped_gemm, config.qk_layernorm, config.multi_latent_attention,
            qk_l2_norm=qk_l2_norm)
    return get_gpt_layer_local_spec(config.num_moe_experts, config.moe_grouped_gemm, config.qk_layernorm,
                                    config.multi_latent_attention, normalization=normalization,
                                    qk_l2_norm=qk_l2_norm)


def get_gpt_mtp_block_spec(config, spec, use_transformer_engine, vp_stage=None, pp_rank=None):
    """The multi-token-prediction block of `config` (`--mtp-num-layers`), or None without one (as upstream).
    `spec` is the layer spec of the MTP depths (checked against the config); the depths run on the last pipeline
    stage, which `GPTModel` knows from `post_process`, so `vp_stage` and `pp_rank` are not needed to place them."""
    if not config.mtp_num_layers:
        return None
    if isinstance(spec, ModuleSpec):
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
    _check_config_fields("mtp_block_spec", spec, config)


def _check_config_fields(argument, spec, config):
    for name, wanted in spec.config_fields.items():
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


def check_layer_spec(spec, config):
    """Raise unless `spec` (None: no spec) describes the layers `config` builds."""
    if spec is None:
        return
    if not isinstance(spec, ModuleSpec) or spec.module is not TransformerLayer:
        raise TypeError(
            f"transformer_layer_spec must come from get_gpt_layer_local_spec() or "
            f"get_gpt_layer_with_transformer_engine_spec() (layers are built from the TransformerConfig), got "
            f"{spec!r}; GPTModel's arguments are (config, transformer_layer_spec, vocab_size, max_sequence_length) "
            "as upstream")
    _check_config_fields("transformer_layer_spec", spec, config)

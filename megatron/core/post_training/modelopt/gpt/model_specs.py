"""`get_gpt_modelopt_spec`: upstream's layer spec of a GPT built for nvidia-modelopt, whose Megatron plugins
quantize, distil and prune the torch-native layers (column- and row-parallel linears, separate norms, no fused
Transformer Engine modules).

Here those are the `--transformer-impl local` layers, so the spec is `get_gpt_layer_local_spec()`'s for the config
(a `TransformerBlockSubmodules` of one spec per layer where MoE and dense layers mix, as upstream), and
`GPTModel(config, transformer_layer_spec=...)` builds the same model as without a spec. Upstream's options:
- `remap_te_layernorm`: upstream adds hooks that load a Transformer Engine checkpoint (norm weights inside
  `linear_qkv` / `linear_fc1`) into the separate norms. Both implementations here already save and load the norms
  under the same names (`input_layernorm.weight`, ...), so nothing is remapped.
- `use_arbitrary_attention_mask`: the local attention applies a given `attention_mask` as it is and is causal
  without one, which is what the arbitrary mask type does; `local_core_attention`: the core attention is local.
- `real_quant_cfg`: real (not fake) low-bit linears are not available; only "None" is accepted.

modelopt's EAGLE speculative-decoding plugin (`modelopt.torch.speculative.plugins.megatron_eagle`) also calls this
function, but its conversion does not run against this megatron.core: it assigns attributes on the
`TransformerConfig` it builds (`transformer_layer_spec`, `seq_length`, ...; this config is frozen) and replaces
submodules of the returned spec.
For draft-model speculative decoding distil a smaller draft GPT (examples/post_training/distill.py); for EAGLE
heads export the checkpoint to Hugging Face format (tools/checkpoint/convert_checkpoint.py --to hf) and use
modelopt's Hugging Face EAGLE plugin.
"""

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.transformer.moe.moe_config import moe_layer_pattern


def _check_arguments(config, real_quant_cfg):
    if config is None:
        raise TypeError("get_gpt_modelopt_spec(config, ...) needs the model's TransformerConfig (the spec matches "
                        "its layers)")
    if real_quant_cfg not in (None, "None"):
        raise ValueError(f"get_gpt_modelopt_spec(real_quant_cfg={real_quant_cfg!r}): real low-bit quantized linears "
                         "are not available; pass real_quant_cfg='None' and fake-quantize the model with modelopt "
                         "(examples/post_training/quantize.py --quant-cfg ...)")
    if config.transformer_impl != "local":
        raise ValueError(f"get_gpt_modelopt_spec builds modelopt's torch-native layers, but the TransformerConfig has "
                         f"transformer_impl={config.transformer_impl!r}: build it with transformer_impl='local' "
                         "(--transformer-impl local; checkpoints load into either implementation)")


def get_gpt_modelopt_spec(config=None, local_core_attention=False, remap_te_layernorm=False, real_quant_cfg="None",
                          use_arbitrary_attention_mask=False):
    """The spec of `config`'s torch-native GPT layers for modelopt (see the module docstring for the options)."""
    _check_arguments(config, real_quant_cfg)
    is_moe = moe_layer_pattern(config)
    if any(is_moe) and not all(is_moe):
        return get_gpt_decoder_block_spec(config, use_transformer_engine=False, qk_l2_norm=config.qk_l2_norm)
    return get_gpt_layer_local_spec(config.num_moe_experts, config.moe_grouped_gemm, config.qk_layernorm,
                                    config.multi_latent_attention, qk_l2_norm=config.qk_l2_norm)

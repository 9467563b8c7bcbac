"""`get_gpt_modelopt_spec`: upstream's layer spec of a GPT transformer layer built for modelopt (local layers,
no fused TE modules), from which modelopt's EAGLE speculative-decoding plugin
(`modelopt.torch.speculative.plugins.megatron_eagle`) builds its draft decoder layers.

Layers here are built from a `TransformerConfig` directly (see `transformer_layer.py`); `TransformerBlock` only
checks a spec against the config and never builds a spec's modules, so there is no spec to return that anything
could build. A spec alone would not make EAGLE run either:
its conversion (`mtsp.convert(model, [("eagle", cfg)])`) builds a `TransformerConfig` and then assigns attributes
on it (`transformer_layer_spec`, which is no field here, `seq_length`, `hidden_size`,
`pipeline_model_parallel_size`, ...), where this config is frozen; it builds
`TransformerBlock(config, spec=..., post_layer_norm=...)` from its own layer modules, uses upstream's
`RotaryEmbedding.get_rotary_seq_len`, and calls the decoder with `packed_seq_params` (packed sequences, which the
block here refuses).
The function keeps its upstream name and signature and says precisely that, and what to use instead.
"""

UNSUPPORTED_MESSAGE = (
    "get_gpt_modelopt_spec: modelopt's EAGLE speculative decoding (modelopt.torch.speculative.plugins."
    "megatron_eagle) is not supported by this megatron.core. Its draft module is built from upstream module "
    "specs, and transformer layers here are built from TransformerConfig directly (TransformerBlock only checks "
    "a spec against the config), so there is no layer spec to return. Beyond the spec, modelopt's EAGLE "
    "conversion needs upstream's mutable TransformerConfig, on which it assigns transformer_layer_spec, seq_length, "
    "... after building it (this one is frozen and validated once, and has no transformer_layer_spec field), "
    "TransformerBlock(spec=...) building the spec's own modules, upstream's RotaryEmbedding.get_rotary_seq_len and "
    "decoder calls with packed_seq_params (the block here refuses packed sequences). "
    "Instead: for draft-model speculative decoding, distil a smaller draft GPT from this model "
    "(examples/post_training/distill.py, or width-prune it first with examples/post_training/prune.py); for EAGLE "
    "heads, export the checkpoint to Hugging Face format (tools/checkpoint/convert_checkpoint.py --to hf) and "
    "train them with modelopt's Hugging Face EAGLE plugin (modelopt.torch.speculative.plugins.hf_eagle) under the "
    "transformers version modelopt supports (pip install 'nvidia-modelopt[hf]')."
)


def get_gpt_modelopt_spec(config=None, local_core_attention=False, remap_te_layernorm=False, real_quant_cfg="None",
                          use_arbitrary_attention_mask=False, **kwargs):
    raise NotImplementedError(UNSUPPORTED_MESSAGE)

"""`get_gpt_modelopt_spec`: upstream's layer spec of a GPT transformer layer built for modelopt (local layers,
no fused TE modules), which modelopt's EAGLE speculative-decoding plugin builds its draft layers from.

Layers here are built directly from a `TransformerConfig` (see `transformer_layer.py`), not from module specs,
so there is no spec to return: the function exists under its upstream name and says so when called.
"""


def get_gpt_modelopt_spec(config=None, local_core_attention=False, remap_te_layernorm=False, real_quant_cfg="None",
                          use_arbitrary_attention_mask=False, **kwargs):
    raise NotImplementedError(
        "get_gpt_modelopt_spec: transformer layers here are built from TransformerConfig directly, not from "
        "module specs, so modelopt features that build layers from a spec (EAGLE / Medusa speculative decoding "
        "draft heads) are not available; quantization, distillation and checkpointing of GPTModel do not need it"
    )

"""Ours -> Hugging Face: the HF tensors of our logical model tensors, and the extras HF has no place for."""

from typing import Dict

import torch

from hf_errors import ConversionError
from hf_families import GPT2, O_PROJ_BIAS_WITH_ATTENTION_BIAS
from hf_gpt_oss import GPT_OSS, gpt_oss_layer_to_hf
from hf_layouts import (
    FP8_BUFFER_SUFFIXES,
    OUTPUT_LAYER,
    PADDING_SUFFIX,
    POSITION_EMBEDDING,
    WORD_EMBEDDING,
    TensorSource,
    query_key_rows,
    split_gate_up,
    split_qkv,
)
from hf_moe import moe_layer_to_hf
from hf_shape import ModelShape


def to_hf_tensors(model: Dict[str, torch.Tensor], shape: ModelShape, architecture: str,
                  dtype: torch.dtype = torch.float32):
    """(HF tensors by HF name in `dtype`, extras by our name in fp32) of our fp32 model tensors by logical name."""
    source, hf, extras = TensorSource(model, "the checkpoint", "its recorded arguments"), {}, {}
    qkv_rows = (shape.num_attention_heads + 2 * shape.num_query_groups) * shape.kv_channels

    def norm(name):
        weight = source.take(name)
        if not shape.apply_layernorm_1p or name.endswith(".bias"):
            return weight
        extras[name] = weight
        return weight + 1

    def bias(name, rows):
        return source.take(name) if shape.add_bias_linear else torch.zeros(rows)

    vocab = shape.vocab_size

    def unpadded(name):
        table = source.take(name, (shape.padded_vocab_size, shape.hidden_size))
        extras[name + PADDING_SUFFIX] = table[vocab:]
        return table[:vocab]

    gpt2 = architecture == GPT2
    if gpt2:
        hf["transformer.wte.weight"] = unpadded(WORD_EMBEDDING)
        hf["transformer.wpe.weight"] = source.take(POSITION_EMBEDDING)
    else:
        hf["model.embed_tokens.weight"] = unpadded(WORD_EMBEDDING)
    hidden, ffn = shape.hidden_size, shape.ffn_hidden_size
    for index in range(shape.num_layers):
        ours = f"decoder.layers.{index}."
        if gpt2:
            theirs = f"transformer.h.{index}."
            for norm_name, hf_norm in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
                for kind in ("weight", "bias"):
                    hf[f"{theirs}{hf_norm}.{kind}"] = norm(f"{ours}{norm_name}.{kind}")
            qkv = split_qkv(source.take(ours + "self_attention.linear_qkv.weight", (qkv_rows, hidden)), shape)
            hf[theirs + "attn.c_attn.weight"] = torch.cat(qkv).t()
            hf[theirs + "attn.c_attn.bias"] = (
                torch.cat(split_qkv(source.take(ours + "self_attention.linear_qkv.bias"), shape))
                if shape.qkv_bias else torch.zeros(3 * hidden))
            hf[theirs + "attn.c_proj.weight"] = source.take(ours + "self_attention.linear_proj.weight").t()
            hf[theirs + "attn.c_proj.bias"] = bias(ours + "self_attention.linear_proj.bias", hidden)
            hf[theirs + "mlp.c_fc.weight"] = source.take(ours + "mlp.linear_fc1.weight").t()
            hf[theirs + "mlp.c_fc.bias"] = bias(ours + "mlp.linear_fc1.bias", ffn)
            hf[theirs + "mlp.c_proj.weight"] = source.take(ours + "mlp.linear_fc2.weight").t()
            hf[theirs + "mlp.c_proj.bias"] = bias(ours + "mlp.linear_fc2.bias", hidden)
            continue
        theirs = f"model.layers.{index}."
        hf[theirs + "input_layernorm.weight"] = norm(ours + "input_layernorm.weight")
        hf[theirs + "post_attention_layernorm.weight"] = norm(ours + "pre_mlp_layernorm.weight")
        if shape.qk_layernorm:  # one norm over head_dim, its channels in the order of the q and k rows
            for our_norm, hf_norm in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
                hf[f"{theirs}self_attn.{hf_norm}.weight"] = query_key_rows(
                    norm(f"{ours}self_attention.{our_norm}.weight"), shape, to_hf=True)
        linears = {"self_attention.linear_proj": "self_attn.o_proj", "mlp.linear_fc2": "mlp.down_proj"}
        for kind in ("weight", "bias") if shape.qkv_bias else ("weight",):
            columns = (hidden,) if kind == "weight" else ()
            query, key, value = split_qkv(source.take(f"{ours}self_attention.linear_qkv.{kind}", (qkv_rows, *columns)),
                                          shape)
            hf[f"{theirs}self_attn.q_proj.{kind}"] = query_key_rows(query, shape, to_hf=True)
            hf[f"{theirs}self_attn.k_proj.{kind}"] = query_key_rows(key, shape, to_hf=True)
            hf[f"{theirs}self_attn.v_proj.{kind}"] = value
        if not shape.add_bias_linear and shape.add_qkv_bias and architecture in O_PROJ_BIAS_WITH_ATTENTION_BIAS:
            hf[theirs + "self_attn.o_proj.bias"] = torch.zeros(hidden)
        if architecture == GPT_OSS:  # sinks, o_proj, router and packed experts
            hf.update(gpt_oss_layer_to_hf(source.take, shape, ours, theirs))
        elif shape.moe_layers[index]:  # no biases (hf_families refuses them)
            hf[theirs + "self_attn.o_proj.weight"] = source.take(ours + "self_attention.linear_proj.weight")
            hf.update(moe_layer_to_hf(source.take, shape, architecture, ours, theirs))
        dense_kinds = ("weight", "bias") if shape.add_bias_linear else ("weight",)
        for kind in () if shape.moe_layers[index] else dense_kinds:
            gate, up = split_gate_up(source.take(f"{ours}mlp.linear_fc1.{kind}"))
            hf[f"{theirs}mlp.gate_proj.{kind}"], hf[f"{theirs}mlp.up_proj.{kind}"] = gate, up
            for our_linear, hf_linear in linears.items():
                hf[f"{theirs}{hf_linear}.{kind}"] = source.take(f"{ours}{our_linear}.{kind}")
    final_norm = "transformer.ln_f" if gpt2 else "model.norm"
    for kind in ("weight", "bias") if gpt2 else ("weight",):
        hf[f"{final_norm}.{kind}"] = norm(f"decoder.final_layernorm.{kind}")
    if shape.untie_embeddings_and_output_weights:
        hf["lm_head.weight"] = unpadded(OUTPUT_LAYER)
    for name in list(source.tensors):
        if name.endswith(FP8_BUFFER_SUFFIXES):
            extras[name] = source.take(name)
    if source.tensors:
        raise ConversionError(f"the checkpoint's tensors {sorted(source.tensors)[:4]} have no place in a Hugging "
                              f"Face {architecture} built from its arguments; were they written by another model?")
    return {name: tensor.to(dtype).contiguous() for name, tensor in hf.items()}, \
        {name: tensor.contiguous() for name, tensor in extras.items()}

"""Hugging Face -> ours: our logical fp32 model tensors of an HF model's tensors and the extras beside them."""

from typing import Dict

import torch

from hf_config import EXTRAS_FILE
from hf_errors import ConversionError
from hf_families import GPT2
from hf_gpt_oss import GPT_OSS, gpt_oss_layer_from_hf
from hf_layouts import (
    FP8_BUFFER_SUFFIXES,
    OUTPUT_LAYER,
    PADDING_SUFFIX,
    POSITION_EMBEDDING,
    WORD_EMBEDDING,
    TensorSource,
    fuse_gate_up,
    fuse_qkv,
    query_key_rows,
)
from hf_moe import moe_layer_from_hf
from hf_shape import ModelShape


def _with_gpt2_prefix(tensors):
    """GPT2LMHeadModel names; a GPT2Model file (names without 'transformer.') reads the same."""
    return {name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name: tensor
            for name, tensor in tensors.items()}


def from_hf_tensors(hf_tensors: Dict[str, torch.Tensor], extras: Dict[str, torch.Tensor], shape: ModelShape,
                    architecture: str, where: str) -> Dict[str, torch.Tensor]:
    """Our logical fp32 model tensors from HF tensors (any float dtype) and the extras (possibly empty)."""
    gpt2 = architecture == GPT2
    hf_tensors = {name: tensor.float() for name, tensor in hf_tensors.items()}
    hf_tensors = _with_gpt2_prefix(hf_tensors) if gpt2 else hf_tensors
    source = TensorSource(hf_tensors, where, "config.json")
    model = {}
    hidden, ffn, vocab = shape.hidden_size, shape.ffn_hidden_size, shape.vocab_size
    heads_width = shape.num_attention_heads * shape.kv_channels
    groups_width = shape.num_query_groups * shape.kv_channels

    def norm(name, hf_name, width=hidden, to_ours=lambda tensor: tensor):
        weight = to_ours(source.take(hf_name, (width,)))
        if not shape.apply_layernorm_1p or name.endswith(".bias"):
            model[name] = weight
            return
        stored = weight - 1
        recorded = extras.get(name)
        if recorded is not None and recorded.shape == weight.shape:
            stored = torch.where(recorded + 1 == weight, recorded, stored)
        model[name] = stored

    def bias(name, hf_name, rows, to_ours=lambda tensor: tensor, kept=shape.add_bias_linear):
        tensor = source.take(hf_name, (rows,))
        if kept:
            model[name] = to_ours(tensor)
        elif torch.count_nonzero(tensor) and gpt2:
            raise ConversionError(f"{where}: '{hf_name}' is not zero, but the model was exported with "
                                  f"--disable-bias-linear (as {EXTRAS_FILE} records); delete that file to import "
                                  "it as a model with biases")
        elif torch.count_nonzero(tensor):
            raise ConversionError(f"{where}: '{hf_name}' is not zero, but config.json's attention_bias without "
                                  "mlp_bias reads as --disable-bias-linear --add-qkv-bias, whose attention output "
                                  "projection has no bias")

    def padded(name, hf_name):
        table = source.take(hf_name, (vocab, hidden))
        padding = extras.get(name + PADDING_SUFFIX)
        rows = shape.padded_vocab_size - vocab
        if padding is None or tuple(padding.shape) != (rows, hidden):
            padding = torch.zeros(rows, hidden)
        model[name] = torch.cat((table, padding))

    if gpt2:
        padded(WORD_EMBEDDING, "transformer.wte.weight")
        model[POSITION_EMBEDDING] = source.take("transformer.wpe.weight", (shape.max_position_embeddings, hidden))
    else:
        padded(WORD_EMBEDDING, "model.embed_tokens.weight")
    for index in range(shape.num_layers):
        ours = f"decoder.layers.{index}."
        if gpt2:
            theirs = f"transformer.h.{index}."
            for norm_name, hf_norm in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
                for kind in ("weight", "bias"):
                    norm(f"{ours}{norm_name}.{kind}", f"{theirs}{hf_norm}.{kind}")
            qkv = source.take(theirs + "attn.c_attn.weight", (hidden, 3 * hidden)).t()
            model[ours + "self_attention.linear_qkv.weight"] = fuse_qkv(*qkv.split(hidden), shape)
            bias(ours + "self_attention.linear_qkv.bias", theirs + "attn.c_attn.bias", 3 * hidden,
                 lambda qkv_bias: fuse_qkv(*qkv_bias.split(hidden), shape), kept=shape.qkv_bias)
            model[ours + "self_attention.linear_proj.weight"] = source.take(
                theirs + "attn.c_proj.weight", (hidden, hidden)).t()
            bias(ours + "self_attention.linear_proj.bias", theirs + "attn.c_proj.bias", hidden)
            model[ours + "mlp.linear_fc1.weight"] = source.take(theirs + "mlp.c_fc.weight", (hidden, ffn)).t()
            bias(ours + "mlp.linear_fc1.bias", theirs + "mlp.c_fc.bias", ffn)
            model[ours + "mlp.linear_fc2.weight"] = source.take(theirs + "mlp.c_proj.weight", (ffn, hidden)).t()
            bias(ours + "mlp.linear_fc2.bias", theirs + "mlp.c_proj.bias", hidden)
            for buffer in ("attn.bias", "attn.masked_bias"):  # causal-mask buffers older GPT-2 files carry
                source.tensors.pop(theirs + buffer, None)
            continue
        theirs = f"model.layers.{index}."
        norm(ours + "input_layernorm.weight", theirs + "input_layernorm.weight")
        norm(ours + "pre_mlp_layernorm.weight", theirs + "post_attention_layernorm.weight")
        if shape.qk_layernorm:
            for our_norm, hf_norm in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
                norm(f"{ours}self_attention.{our_norm}.weight", f"{theirs}self_attn.{hf_norm}.weight",
                     shape.kv_channels, lambda weight: query_key_rows(weight, shape, to_hf=False))
        for kind in ("weight", "bias") if shape.qkv_bias else ("weight",):
            columns = (hidden,) if kind == "weight" else ()
            query = source.take(f"{theirs}self_attn.q_proj.{kind}", (heads_width, *columns))
            key = source.take(f"{theirs}self_attn.k_proj.{kind}", (groups_width, *columns))
            value = source.take(f"{theirs}self_attn.v_proj.{kind}", (groups_width, *columns))
            model[f"{ours}self_attention.linear_qkv.{kind}"] = fuse_qkv(
                query_key_rows(query, shape, to_hf=False), query_key_rows(key, shape, to_hf=False), value, shape)
        if not shape.add_bias_linear and shape.add_qkv_bias and theirs + "self_attn.o_proj.bias" in source.tensors:
            # Llama's attention_bias gives o_proj a bias, which must be zero; Qwen2's o_proj has none
            bias(ours + "self_attention.linear_proj.bias", theirs + "self_attn.o_proj.bias", hidden)
        if architecture == GPT_OSS:  # sinks, o_proj, router and packed experts
            model.update(gpt_oss_layer_from_hf(source.take, shape, ours, theirs, where))
        elif shape.moe_layers[index]:  # no biases (hf_families refuses them)
            model[ours + "self_attention.linear_proj.weight"] = source.take(theirs + "self_attn.o_proj.weight",
                                                                            (hidden, heads_width))
            model.update(moe_layer_from_hf(source.take, shape, architecture, ours, theirs))
        dense_kinds = ("weight", "bias") if shape.add_bias_linear else ("weight",)
        for kind in () if shape.moe_layers[index] else dense_kinds:
            columns = (hidden,) if kind == "weight" else ()
            model[f"{ours}self_attention.linear_proj.{kind}"] = source.take(
                f"{theirs}self_attn.o_proj.{kind}", (hidden, heads_width)[:len(columns) + 1])
            gate = source.take(f"{theirs}mlp.gate_proj.{kind}", (ffn, *columns))
            up = source.take(f"{theirs}mlp.up_proj.{kind}", (ffn, *columns))
            model[f"{ours}mlp.linear_fc1.{kind}"] = fuse_gate_up(gate, up)
            model[f"{ours}mlp.linear_fc2.{kind}"] = source.take(
                f"{theirs}mlp.down_proj.{kind}", (hidden, ffn)[:len(columns) + 1])
        source.tensors.pop(theirs + "self_attn.rotary_emb.inv_freq", None)  # a buffer older Llama files carry
    final_norm = "transformer.ln_f" if gpt2 else "model.norm"
    for kind in ("weight", "bias") if gpt2 else ("weight",):
        norm(f"decoder.final_layernorm.{kind}", f"{final_norm}.{kind}")
    if shape.untie_embeddings_and_output_weights:
        padded(OUTPUT_LAYER, "lm_head.weight")
    else:
        lm_head = source.tensors.pop("lm_head.weight", None)  # some writers save the tied copy as well
        if lm_head is not None and not torch.equal(lm_head, hf_tensors.get("transformer.wte.weight" if gpt2 else
                                                                            "model.embed_tokens.weight", lm_head)):
            raise ConversionError(f"{where}: 'lm_head.weight' differs from the word embedding, but config.json "
                                  "says tie_word_embeddings; set it to false to import an untied output layer")
    if source.tensors:
        raise ConversionError(f"{where}: tensors {sorted(source.tensors)[:4]} have no place in our GPT model as "
                              "config.json describes it")
    for name, tensor in extras.items():
        if name.endswith(FP8_BUFFER_SUFFIXES):
            model[name] = tensor
    return {name: tensor.contiguous() for name, tensor in model.items()}

"""The tensors of a hybrid Mamba model both ways: ours <-> Hugging Face NemotronHForCausalLM / Mamba2ForCausalLM.

| ours (`decoder.layers.{i}.`) | HF (`backbone.layers.{i}.`) |
|---|---|
| `norm` (M), `input_layernorm` (*), `pre_mlp_layernorm` (-) | `norm` |
| `mixer.in_proj`, `mixer.conv1d` weight and bias | the same, rows / channels group-major <-> kind-major |
| `mixer.A_log`, `mixer.D`, `mixer.dt_bias`, `mixer.norm`, `mixer.out_proj` | the same |
| `self_attention.linear_qkv` | `mixer.q_proj`, `mixer.k_proj`, `mixer.v_proj` |
| `self_attention.linear_proj` | `mixer.o_proj` |
| `mlp.linear_fc1`, `mlp.linear_fc2` | `mixer.up_proj`, `mixer.down_proj` |
| `pre_mlp_layernorm` (E), `mlp.router.weight` | `norm`, `mixer.gate.weight` |
| `mlp.router.expert_bias` (zeros without --moe-router-enable-expert-bias) | `mixer.gate.e_score_correction_bias` |
| `mlp.experts.local_experts.{e}.linear_fc1`, `linear_fc2` | `mixer.experts.{e}.up_proj`, `down_proj` |
| `mlp.fc1_latent_proj`, `mlp.fc2_latent_proj` (--moe-latent-size) | `mixer.fc1_latent_proj`, `fc2_latent_proj` |
| `mlp.shared_experts.linear_fc1`, `linear_fc2` | `mixer.shared_experts.up_proj`, `down_proj` |

The embedding (`backbone.embeddings`), final norm (`backbone.norm_f`) and output layer (`lm_head`) go as Llama's do
(hf_import_tensors / hf_export_tensors: vocabulary padding, tied output layer, --apply-layernorm-1p). transformers'
Nemotron-H computes with its own lm_head even when config.json says tie_word_embeddings, so a tied model is
written with lm_head a copy of the embedding. Without conv biases (`use_conv_bias` false) ours are zeros, and the
export leaves them out again while they stay zero. The expert bias, an fp32 buffer in both, is written in fp32.
"""

import dataclasses
from typing import Dict

import torch
from megatron.core.ssm.mamba_config import ATTENTION, MAMBA, MLP, MOE

from hf_errors import ConversionError
from hf_hybrid import CONV_KERNEL, NEMOTRON_H
from hf_layouts import TensorSource, fuse_qkv, mamba_rows, split_qkv
from hf_shape import ModelShape

LLAMA = "LlamaForCausalLM"  # whose embedding, final norm and output layer names the generic code maps
# Our norm of each layer kind; HF's is `norm` in every block.
LAYER_NORMS = {MAMBA: "norm.weight", ATTENTION: "input_layernorm.weight", MLP: "pre_mlp_layernorm.weight",
               MOE: "pre_mlp_layernorm.weight"}
# HF names of the embedding and final norm -> the Llama names the generic code maps.
AS_LLAMA = {"backbone.embeddings.weight": "model.embed_tokens.weight", "backbone.norm_f.weight": "model.norm.weight"}
# Mixer tensors that map one to one, under `mixer.`: one entry per head, per inner channel.
_PER_HEAD, _PER_CHANNEL = ("A_log", "D", "dt_bias"), ("norm.weight",)


def _without_layers(shape: ModelShape) -> ModelShape:
    """`shape` without layers: the embedding, final norm and output layer the generic code maps."""
    return dataclasses.replace(shape, num_layers=0, hybrid_layer_pattern=None, num_experts=None, moe_layer_freq=1,
                               qk_layernorm=False, add_qkv_bias=False, add_bias_linear=False)


def _hf_names(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Tensors under `backbone.` names: transformers' own module names (`model.`) and older Mamba2 files'
    `backbone.embedding` read the same."""
    renamed = {}
    for name, tensor in tensors.items():
        name = "backbone." + name[len("model."):] if name.startswith("model.") else name
        renamed["backbone.embeddings.weight" if name == "backbone.embedding.weight" else name] = tensor
    return renamed


def _sizes(shape: ModelShape):
    """(in_proj rows, conv channels, heads, inner width) of the mixer."""
    groups, state, heads, inner = (shape.mamba_num_groups, shape.mamba_state_dim, shape.mamba_heads,
                                   shape.mamba_inner_size)
    return 2 * inner + 2 * groups * state + heads, inner + 2 * groups * state, heads, inner


def _plain_tensors(shape: ModelShape, symbol: str, ours: str, theirs: str):
    """(our name, HF name, shape) of a layer's tensors that map one to one, its norm first."""
    hidden = shape.hidden_size
    plain = [(ours + LAYER_NORMS[symbol], theirs + "norm.weight", (hidden,))]
    if symbol == MAMBA:
        _, _, heads, inner = _sizes(shape)
        plain += [(f"{ours}mixer.{name}", f"{theirs}mixer.{name}", (heads,)) for name in _PER_HEAD]
        plain += [(f"{ours}mixer.{name}", f"{theirs}mixer.{name}", (inner,)) for name in _PER_CHANNEL]
        plain.append((ours + "mixer.out_proj.weight", theirs + "mixer.out_proj.weight", (hidden, inner)))
    elif symbol == ATTENTION:
        plain.append((ours + "self_attention.linear_proj.weight", theirs + "mixer.o_proj.weight",
                      (hidden, shape.num_attention_heads * shape.kv_channels)))
    elif symbol == MOE:
        plain.append((ours + "mlp.router.weight", theirs + "mixer.gate.weight", (shape.num_experts, hidden)))
        latent = shape.moe_latent_size
        if latent:  # the routed experts read and write the latent width
            plain += [(ours + "mlp.fc1_latent_proj.weight", theirs + "mixer.fc1_latent_proj.weight", (latent, hidden)),
                      (ours + "mlp.fc2_latent_proj.weight", theirs + "mixer.fc2_latent_proj.weight", (hidden, latent))]
        mlps = [(f"{ours}mlp.experts.local_experts.{expert}.", f"{theirs}mixer.experts.{expert}.",
                 shape.moe_ffn_hidden_size, latent or hidden) for expert in range(shape.num_experts)]
        mlps.append((ours + "mlp.shared_experts.", theirs + "mixer.shared_experts.",
                     shape.moe_shared_expert_intermediate_size, hidden))
        for our_prefix, hf_prefix, width, token_width in mlps:
            plain += [(our_prefix + "linear_fc1.weight", hf_prefix + "up_proj.weight", (width, token_width)),
                      (our_prefix + "linear_fc2.weight", hf_prefix + "down_proj.weight", (token_width, width))]
    else:
        plain += [(ours + "mlp.linear_fc1.weight", theirs + "mixer.up_proj.weight", (shape.ffn_hidden_size, hidden)),
                  (ours + "mlp.linear_fc2.weight", theirs + "mixer.down_proj.weight", (hidden, shape.ffn_hidden_size))]
    return plain


def _layers(shape: ModelShape):
    for index, symbol in enumerate(shape.hybrid_layer_pattern):
        yield symbol, f"decoder.layers.{index}.", f"backbone.layers.{index}."


def from_hf_tensors(hf_tensors: Dict[str, torch.Tensor], extras: Dict[str, torch.Tensor], shape: ModelShape,
                    where: str, conv_bias: bool = True) -> Dict[str, torch.Tensor]:
    """Our logical fp32 model tensors of a Nemotron-H or Mamba2 directory's tensors (any float dtype) and the
    extras beside them; `conv_bias`: config.json's use_conv_bias (false: ours are zeros)."""
    import hf_import_tensors

    source = TensorSource({name: tensor.float() for name, tensor in _hf_names(hf_tensors).items()}, where,
                          "config.json")
    model, hidden = {}, shape.hidden_size
    rows, channels, _, _ = _sizes(shape)
    for symbol, ours, theirs in _layers(shape):
        for index, (our_name, hf_name, size) in enumerate(_plain_tensors(shape, symbol, ours, theirs)):
            tensor = source.take(hf_name, size)
            model[our_name] = _stored_norm(our_name, tensor, shape, extras) if index == 0 else tensor
        if symbol == MAMBA:
            mixer, hf_mixer = ours + "mixer.", theirs + "mixer."
            model[mixer + "in_proj.weight"] = mamba_rows(source.take(hf_mixer + "in_proj.weight", (rows, hidden)),
                                                         shape, to_hf=False)
            model[mixer + "conv1d.weight"] = mamba_rows(source.take(hf_mixer + "conv1d.weight",
                                                                    (channels, 1, CONV_KERNEL)),
                                                        shape, to_hf=False, with_gate_and_step=False)
            bias = source.take(hf_mixer + "conv1d.bias", (channels,)) if conv_bias else torch.zeros(channels)
            model[mixer + "conv1d.bias"] = mamba_rows(bias, shape, to_hf=False, with_gate_and_step=False)
        elif symbol == ATTENTION:
            heads_width = shape.num_attention_heads * shape.kv_channels
            groups_width = shape.num_query_groups * shape.kv_channels
            query, key, value = (source.take(f"{theirs}mixer.{name}.weight", (width, hidden)) for name, width in
                                 (("q_proj", heads_width), ("k_proj", groups_width), ("v_proj", groups_width)))
            model[ours + "self_attention.linear_qkv.weight"] = fuse_qkv(query, key, value, shape)
        elif symbol == MOE:
            bias = source.take(theirs + "mixer.gate.e_score_correction_bias", (shape.num_experts,))
            if shape.moe_router_enable_expert_bias:
                model[ours + "mlp.router.expert_bias"] = bias
            elif torch.count_nonzero(bias):
                raise ConversionError(f"{where}: '{theirs}mixer.gate.e_score_correction_bias' is not zero, but the "
                                      "model it was exported from had no --moe-router-enable-expert-bias")
    rest = {name: tensor for name, tensor in source.tensors.items() if name in (*AS_LLAMA, "lm_head.weight")}
    unknown = sorted(set(source.tensors) - set(rest))
    if unknown:
        raise ConversionError(f"{where}: tensors {unknown[:4]} have no place in our hybrid model as config.json "
                              "describes it")
    rest = {AS_LLAMA.get(name, name): tensor for name, tensor in rest.items()}
    model.update(hf_import_tensors.from_hf_tensors(rest, extras, _without_layers(shape), LLAMA, where))
    return {name: tensor.contiguous() for name, tensor in model.items()}


def _stored_norm(name, gamma, shape, extras):
    """Our norm weight of HF's gamma: gamma - 1 with --apply-layernorm-1p (the recorded value where it still gives
    gamma), gamma otherwise."""
    if not shape.apply_layernorm_1p:
        return gamma
    recorded = extras.get(name)
    if recorded is not None and recorded.shape == gamma.shape:
        return torch.where(recorded + 1 == gamma, recorded, gamma - 1)
    return gamma - 1


def to_hf_tensors(model: Dict[str, torch.Tensor], shape: ModelShape, architecture: str,
                  dtype: torch.dtype = torch.float32, conv_bias: bool = True):
    """(HF tensors by HF name in `dtype`, extras by our name in fp32) of our fp32 model tensors of a hybrid
    model. Without `conv_bias` (the use_conv_bias false an import recorded) conv biases that are all zero are left
    out; `has_conv_bias` tells what was written."""
    import hf_export_tensors

    source, hf, extras, fp32 = TensorSource(model, "the checkpoint", "its recorded arguments"), {}, {}, set()
    rows, channels, _, _ = _sizes(shape)
    biases = {}
    for symbol, ours, theirs in _layers(shape):
        for index, (our_name, hf_name, size) in enumerate(_plain_tensors(shape, symbol, ours, theirs)):
            tensor = source.take(our_name, size)
            if index == 0 and shape.apply_layernorm_1p:
                extras[our_name], tensor = tensor, tensor + 1
            hf[hf_name] = tensor
        if symbol == MAMBA:
            mixer, hf_mixer = ours + "mixer.", theirs + "mixer."
            in_proj = source.take(mixer + "in_proj.weight", (rows, shape.hidden_size))
            hf[hf_mixer + "in_proj.weight"] = mamba_rows(in_proj, shape, to_hf=True)
            conv = source.take(mixer + "conv1d.weight", (channels, 1, CONV_KERNEL))
            hf[hf_mixer + "conv1d.weight"] = mamba_rows(conv, shape, to_hf=True, with_gate_and_step=False)
            biases[hf_mixer + "conv1d.bias"] = mamba_rows(source.take(mixer + "conv1d.bias", (channels,)), shape,
                                                          to_hf=True, with_gate_and_step=False)
        elif symbol == ATTENTION:
            query, key, value = split_qkv(source.take(ours + "self_attention.linear_qkv.weight"), shape)
            for name, tensor in (("q_proj", query), ("k_proj", key), ("v_proj", value)):
                hf[f"{theirs}mixer.{name}.weight"] = tensor
        elif symbol == MOE:
            name = theirs + "mixer.gate.e_score_correction_bias"
            hf[name] = (source.take(ours + "mlp.router.expert_bias", (shape.num_experts,))
                        if shape.moe_router_enable_expert_bias else torch.zeros(shape.num_experts))
            fp32.add(name)
    if conv_bias or any(torch.count_nonzero(bias) for bias in biases.values()):
        hf.update(biases)
    unknown = [name for name in source.tensors if name.startswith("decoder.layers.")]
    if unknown:
        raise ConversionError(f"the checkpoint's tensors {sorted(unknown)[:4]} have no place in a Hugging Face "
                              f"{architecture} built from its arguments; were they written by another model?")
    rest_hf, rest_extras = hf_export_tensors.to_hf_tensors(source.tensors, _without_layers(shape), LLAMA, dtype)
    extras.update(rest_extras)
    rest_hf = {next((hf_name for hf_name, llama in AS_LLAMA.items() if llama == name), name): tensor
               for name, tensor in rest_hf.items()}
    if architecture == NEMOTRON_H and "lm_head.weight" not in rest_hf:  # it computes with its own lm_head
        rest_hf["lm_head.weight"] = rest_hf["backbone.embeddings.weight"].clone()
    hf = {name: (tensor.float() if name in fp32 else tensor.to(dtype)).contiguous() for name, tensor in hf.items()}
    hf.update(rest_hf)
    return hf, {name: tensor.contiguous() for name, tensor in extras.items()}


def has_conv_bias(hf_tensors: Dict[str, torch.Tensor]) -> bool:
    return any(name.endswith("mixer.conv1d.bias") for name in hf_tensors)

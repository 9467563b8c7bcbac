"""DeciLMForCausalLM (Llama-Nemotron's `nemotron-nas`, e.g. Llama-3.3-Nemotron-Super-49B) both ways: which of our
models it is, its config.json and its tensors.

A DeciLM model is a Llama (RMSNorm, rotate-half RoPE with `rope_scaling`, SwiGLU, no biases) whose layers each take
their shape from `block_configs`, one entry per layer: our heterogeneous layers (--heterogeneous-layers-config-path,
megatron/core/transformer/heterogeneous/). The import records config.json's text itself as
--heterogeneous-layers-config-encoded-json, so that --use-checkpoint-args rebuilds the layers; the export writes the
`block_configs` of the checkpoint's saved JSON. Per layer, as HF's decoder layer computes them:

| block_configs entry | HF `model.layers.{i}.` | ours, `decoder.layers.{i}.` |
|---|---|---|
| attention (n_heads_in_group m) | self_attn.q_proj, k_proj, v_proj, o_proj | self_attention.linear_qkv, linear_proj |
| attention replace_with_linear | self_attn.linear_attn | self_attention.linear_attn |
| ffn (ffn_mult) | mlp.gate_proj, up_proj, down_proj | mlp.linear_fc1 (gate and up rows interleaved), linear_fc2 |
| ffn replace_with_linear | mlp.linear_mlp | mlp.linear_mlp |

An attention (or its linear replacement) reads `input_layernorm`, ours too; an ffn reads `post_attention_layernorm`,
our `pre_mlp_layernorm`; a `no_op` has neither norm nor weights (the residual passes through). An attention has
num_attention_heads / m query groups, each with its q / k / v rows in our fused linear_qkv (hf_layouts.py).

The embedding, final norm and output layer are Llama's. config.json's top-level `num_key_value_heads` and
`intermediate_size` are null (every layer has its own); our model-level --num-query-groups (the heads) and
--ffn-hidden-size (the widest MLP) shape no layer. Refused, naming the key: `attention_bias` / `mlp_bias` (DeciLM's
linear replacements never have biases, ours have them with every other linear), a `hidden_act` other than silu, a
`head_dim` other than hidden_size / num_attention_heads (DeciLM's heads are that wide), YaRN RoPE scaling (not
checked against DeciLM's own code), block configs that select a variant we do not build (block_configs.py), and
block_configs whose length is not num_hidden_layers.
"""

import dataclasses
import json
import shlex
from typing import Dict, Optional

import torch

from megatron.core.transformer.heterogeneous.block_configs import BLOCK_CONFIGS_KEY, parse_block_configs

from hf_errors import ConversionError
from hf_gpt_oss import gpt_oss_feature_problems
from hf_layouts import (
    FP8_BUFFER_SUFFIXES,
    TensorSource,
    fuse_gate_up,
    fuse_qkv,
    query_key_rows,
    split_gate_up,
    split_qkv,
)
from hf_rope import hf_rope_config, rope_flags_of_config
from hf_shape import ModelShape

NEMOTRON_NAS, NEMOTRON_NAS_MODEL_TYPE = "DeciLMForCausalLM", "nemotron-nas"
# DeciLM's config.json keys that our flags do not say and that change nothing computed (the remote code's classes;
# the slices its linear layers sum in, pretraining_tp, which change rounding only): written back from the
# checkpoint's saved JSON.
PASSED_THROUGH_KEYS = ("auto_map", "pretraining_tp")
SILU_NAMES = ("silu", "swish")
OWN_FORMATS = "such a model converts between our own formats only (--to torch / --to safetensors)"


def is_nemotron_nas_config(config: dict) -> bool:
    return NEMOTRON_NAS in (config.get("architectures") or []) or config.get("model_type") == NEMOTRON_NAS_MODEL_TYPE


def _document(shape: ModelShape) -> dict:
    return json.loads(shape.heterogeneous_layers_config_encoded_json)


def layer_blocks(shape: ModelShape):
    """The LayerBlockConfig of each layer of a heterogeneous `shape`."""
    try:
        return parse_block_configs(_document(shape).get(BLOCK_CONFIGS_KEY), hidden_size=shape.hidden_size,
                                   num_attention_heads=shape.num_attention_heads,
                                   source="the checkpoint's --heterogeneous-layers-config-encoded-json")
    except ValueError as error:  # what training would have refused (JSON decoding errors among them)
        raise ConversionError(str(error)) from error


def layer_query_groups(shape: ModelShape) -> list:
    """The key/value heads of every attention layer (those of the model for uniform layers)."""
    if shape.heterogeneous_layers_config_encoded_json is None:
        return [shape.num_query_groups]
    return [block.attention.num_query_groups for block in layer_blocks(shape) if block.attention.is_attention]


# ------------------------------------------------------------------------------------------------------------
# Which models are DeciLM
# ------------------------------------------------------------------------------------------------------------

def nemotron_nas_problems(shape: ModelShape) -> list:
    """What keeps `shape` from being written exactly as a DeciLMForCausalLM (empty when nothing)."""
    if shape.heterogeneous_layers_config_encoded_json is None:
        return [f"no --heterogeneous-layers-config-path: {NEMOTRON_NAS}'s layers each take their shape from "
                "block_configs (a model with uniform layers exports as LlamaForCausalLM)"]
    problems = []
    if shape.position_embedding_type != "rope":
        problems.append(f"--position-embedding-type {shape.position_embedding_type}: {NEMOTRON_NAS} rotates "
                        "(--position-embedding-type rope; YaRN is not checked against DeciLM's own code)")
    if shape.use_rope_scaling and shape.rotary_seq_len_interpolation_factor is not None:
        problems.append("--use-rope-scaling with --rotary-seq-len-interpolation-factor: config.json holds one RoPE "
                        "scaling")
    if shape.rotary_percent != 1.0:
        problems.append(f"--rotary-percent {shape.rotary_percent}: {NEMOTRON_NAS} rotates every channel of a head")
    if shape.normalization != "RMSNorm":
        problems.append(f"--normalization {shape.normalization}: {NEMOTRON_NAS} normalises with RMSNorm")
    if not shape.swiglu:
        problems.append(f"no --swiglu: {NEMOTRON_NAS}'s MLPs are SwiGLU")
    if shape.add_bias_linear or shape.add_qkv_bias:
        problems.append(f"linear biases (no --disable-bias-linear, or --add-qkv-bias): {NEMOTRON_NAS}'s linear "
                        "replacements have none, so the export writes none (attention_bias, mlp_bias false)")
    if shape.qk_layernorm:
        problems.append(f"--qk-layernorm: {NEMOTRON_NAS} does not normalise query and key heads")
    if shape.kv_channels * shape.num_attention_heads != shape.hidden_size:
        problems.append(f"--kv-channels {shape.kv_channels}: {NEMOTRON_NAS}'s heads are --hidden-size / "
                        "--num-attention-heads wide")
    if shape.apply_residual_connection_post_layernorm:
        problems.append(f"--apply-residual-connection-post-layernorm: {NEMOTRON_NAS} adds the un-normalised input "
                        "back")
    if shape.num_experts:
        problems.append(f"--num-experts {shape.num_experts}: {NEMOTRON_NAS}'s MLPs are dense")
    return problems + gpt_oss_feature_problems(shape, NEMOTRON_NAS)


def check_nemotron_nas_architecture(shape: ModelShape, architecture: str, why: str) -> str:
    """NEMOTRON_NAS where `shape` is one exactly; ConversionError listing every flag in the way, or, for a model
    with heterogeneous layers, naming the architecture asked for instead."""
    if architecture != NEMOTRON_NAS:
        raise ConversionError(f"this model cannot be written as a Hugging Face {architecture} ({why}): "
                              f"--heterogeneous-layers-config-path: only {NEMOTRON_NAS} has layers of their own "
                              "shapes")
    problems = nemotron_nas_problems(shape)
    if problems:
        raise ConversionError(f"this model cannot be written as a Hugging Face {NEMOTRON_NAS} ({why}) without "
                              f"changing what it computes: {'; '.join(problems)}; {OWN_FORMATS}")
    return NEMOTRON_NAS


def training_flags(shape: ModelShape, config_path: Optional[str] = None) -> list:
    """pretrain_gpt.py's flag of the heterogeneous layers of `shape`: the config.json at `config_path`, else its
    saved JSON as text (none for a model with uniform layers)."""
    text = shape.heterogeneous_layers_config_encoded_json
    if text is None:
        return []
    if config_path is not None:
        return [f"--heterogeneous-layers-config-path {shlex.quote(config_path)}"]
    compact = json.dumps(json.loads(text), separators=(",", ":"))
    return [f"--heterogeneous-layers-config-encoded-json {shlex.quote(compact)}"]


# ------------------------------------------------------------------------------------------------------------
# config.json
# ------------------------------------------------------------------------------------------------------------

def nemotron_nas_config(shape: ModelShape, common: dict) -> dict:
    """config.json of `shape` as a DeciLMForCausalLM; `common` the keys every architecture has. The block configs
    and PASSED_THROUGH_KEYS are those of the checkpoint's saved JSON."""
    document = _document(shape)
    config = {"model_type": NEMOTRON_NAS_MODEL_TYPE, **common, "hidden_size": shape.hidden_size,
              "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_attention_heads,
              "num_key_value_heads": None, "intermediate_size": None, "hidden_act": "silu",
              "max_position_embeddings": shape.max_position_embeddings, "rms_norm_eps": shape.norm_epsilon,
              "rope_theta": float(shape.rotary_base), **hf_rope_config(shape), "attention_bias": False,
              "mlp_bias": False, "attention_dropout": shape.attention_dropout,
              BLOCK_CONFIGS_KEY: document[BLOCK_CONFIGS_KEY]}
    config.update({key: document[key] for key in PASSED_THROUGH_KEYS if key in document})
    return config


def _positive_int(config, key, path):
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConversionError(f"{path}: config.json's {key} ({value!r}) must be a positive integer")
    return value


def nemotron_nas_flags_of_config(config: dict, path: str, recorded: Optional[dict] = None,
                                 text: Optional[str] = None) -> dict:
    """The ModelShape fields (but the vocabulary, init std and layernorm-1p) of a DeciLM config.json, `text` its
    JSON as read (default: `config` written out); ConversionError naming every key our model cannot compute as
    DeciLM does. `recorded`: the extras' megatron_model."""
    recorded = recorded or {}
    hidden, heads = _positive_int(config, "hidden_size", path), _positive_int(config, "num_attention_heads", path)
    layers = _positive_int(config, "num_hidden_layers", path)
    refusals = [f"{key} true: DeciLM's linear replacements have no biases, ours have them with every other linear "
                "(--disable-bias-linear)" for key in ("attention_bias", "mlp_bias") if config.get(key)]
    if config.get("hidden_act", "silu") not in SILU_NAMES:
        refusals.append(f"hidden_act '{config['hidden_act']}': our gated MLP is SwiGLU (silu)")
    if hidden % heads:
        refusals.append(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    if config.get("head_dim") not in (None, hidden // heads):
        refusals.append(f"head_dim {config['head_dim']}: DeciLM's heads are hidden_size / num_attention_heads "
                        f"({hidden // heads}) wide")
    try:
        rope = rope_flags_of_config(config, path)
    except ConversionError as error:
        refusals.append(str(error).removeprefix(f"{path}: "))
        rope = {}
    if rope.get("position_embedding_type") == "yarn":
        refusals.append("RoPE scaling 'yarn': DeciLM's own code computes it as older transformers did, which our "
                        "YaRN is not checked against")
    try:
        blocks = parse_block_configs(config.get(BLOCK_CONFIGS_KEY), hidden_size=hidden, num_attention_heads=heads,
                                     source="config.json")
    except ValueError as error:
        refusals.append(str(error))
        blocks = ()
    if blocks and len(blocks) != layers:
        refusals.append(f"{len(blocks)} block_configs for num_hidden_layers {layers}: one entry per layer")
    if refusals:
        raise ConversionError(f"{path}: " + "; ".join(refusals))
    widths = [block.mlp.ffn_hidden_size for block in blocks if block.mlp.is_mlp]
    return dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=heads,
                kv_channels=hidden // heads, ffn_hidden_size=max(widths, default=4 * hidden),
                max_position_embeddings=_positive_int(config, "max_position_embeddings", path), **rope,
                rotary_interleaved=recorded.get("rotary_interleaved", False), normalization="RMSNorm",
                norm_epsilon=config.get("rms_norm_eps", 1e-6), swiglu=True, add_bias_linear=False,
                add_qkv_bias=False, untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
                hidden_dropout=recorded.get("hidden_dropout", 0.0),
                attention_dropout=config.get("attention_dropout", 0.0),
                heterogeneous_layers_config_encoded_json=text if text is not None else json.dumps(config, indent=2))


# ------------------------------------------------------------------------------------------------------------
# Tensors
# ------------------------------------------------------------------------------------------------------------

def _layers(shape: ModelShape):
    """(our prefix, HF prefix, block config, the layer's shape: its query groups and MLP width) of every layer."""
    for index, block in enumerate(layer_blocks(shape)):
        groups = block.attention.num_query_groups if block.attention.is_attention else shape.num_query_groups
        width = block.mlp.ffn_hidden_size if block.mlp.is_mlp else shape.ffn_hidden_size
        yield (f"decoder.layers.{index}.", f"model.layers.{index}.", block,
               dataclasses.replace(shape, num_query_groups=groups, ffn_hidden_size=width))


def _norm_names(ours: str, theirs: str, block) -> list:
    names = [] if block.attention.no_op else [(ours + "input_layernorm.weight", theirs + "input_layernorm.weight")]
    if not block.mlp.no_op:
        names.append((ours + "pre_mlp_layernorm.weight", theirs + "post_attention_layernorm.weight"))
    return names


def _without_layers(shape: ModelShape) -> ModelShape:
    """`shape` without layers: the embedding, final norm and output layer that the Llama mapping writes."""
    return dataclasses.replace(shape, num_layers=0, heterogeneous_layers_config_encoded_json=None)


def from_hf_tensors(hf_tensors: Dict[str, torch.Tensor], extras: Dict[str, torch.Tensor], shape: ModelShape,
                    where: str) -> Dict[str, torch.Tensor]:
    """Our logical fp32 model tensors of a DeciLM directory's tensors (any float dtype) and extras."""
    import hf_import_tensors

    source = TensorSource({name: tensor.float() for name, tensor in hf_tensors.items()}, where, "config.json")
    model, hidden = {}, shape.hidden_size
    for ours, theirs, block, layer in _layers(shape):
        for our_name, hf_name in _norm_names(ours, theirs, block):
            weight = source.take(hf_name, (hidden,))
            recorded = extras.get(our_name)
            if shape.apply_layernorm_1p:  # gamma - 1, the recorded value where it still gives gamma
                keep = recorded is not None and recorded.shape == weight.shape
                weight = torch.where(recorded + 1 == weight, recorded, weight - 1) if keep else weight - 1
            model[our_name] = weight
        if block.attention.replace_with_linear:
            model[ours + "self_attention.linear_attn.weight"] = source.take(theirs + "self_attn.linear_attn.weight",
                                                                            (hidden, hidden))
        elif block.attention.is_attention:
            heads_width = layer.num_attention_heads * layer.kv_channels
            groups_width = layer.num_query_groups * layer.kv_channels
            query = source.take(theirs + "self_attn.q_proj.weight", (heads_width, hidden))
            key = source.take(theirs + "self_attn.k_proj.weight", (groups_width, hidden))
            value = source.take(theirs + "self_attn.v_proj.weight", (groups_width, hidden))
            model[ours + "self_attention.linear_qkv.weight"] = fuse_qkv(
                query_key_rows(query, layer, to_hf=False), query_key_rows(key, layer, to_hf=False), value, layer)
            model[ours + "self_attention.linear_proj.weight"] = source.take(theirs + "self_attn.o_proj.weight",
                                                                            (hidden, heads_width))
            source.tensors.pop(theirs + "self_attn.rotary_emb.inv_freq", None)  # a buffer older files carry
        if block.mlp.replace_with_linear:
            model[ours + "mlp.linear_mlp.weight"] = source.take(theirs + "mlp.linear_mlp.weight", (hidden, hidden))
        elif block.mlp.is_mlp:
            width = layer.ffn_hidden_size
            gate = source.take(theirs + "mlp.gate_proj.weight", (width, hidden))
            up = source.take(theirs + "mlp.up_proj.weight", (width, hidden))
            model[ours + "mlp.linear_fc1.weight"] = fuse_gate_up(gate, up)
            model[ours + "mlp.linear_fc2.weight"] = source.take(theirs + "mlp.down_proj.weight", (hidden, width))
    # what is left: the embedding, final norm, output layer, and any tensor no layer took (an error there)
    model.update(hf_import_tensors.from_hf_tensors(source.tensors, extras, _without_layers(shape), "LlamaForCausalLM",
                                                   where))
    return {name: tensor.contiguous() for name, tensor in model.items()}


def to_hf_tensors(model: Dict[str, torch.Tensor], shape: ModelShape, dtype: torch.dtype = torch.float32):
    """(HF tensors by HF name in `dtype`, extras by our name in fp32) of our fp32 model tensors of a DeciLM-shaped
    model."""
    import hf_export_tensors

    source, hf, extras, hidden = TensorSource(model, "the checkpoint", "its recorded arguments"), {}, {}, \
        shape.hidden_size
    for ours, theirs, block, layer in _layers(shape):
        for our_name, hf_name in _norm_names(ours, theirs, block):
            weight = source.take(our_name, (hidden,))
            if shape.apply_layernorm_1p:
                extras[our_name], weight = weight, weight + 1
            hf[hf_name] = weight
        if block.attention.replace_with_linear:
            hf[theirs + "self_attn.linear_attn.weight"] = source.take(ours + "self_attention.linear_attn.weight",
                                                                      (hidden, hidden))
        elif block.attention.is_attention:
            rows = (layer.num_attention_heads + 2 * layer.num_query_groups) * layer.kv_channels
            query, key, value = split_qkv(source.take(ours + "self_attention.linear_qkv.weight", (rows, hidden)),
                                          layer)
            hf[theirs + "self_attn.q_proj.weight"] = query_key_rows(query, layer, to_hf=True)
            hf[theirs + "self_attn.k_proj.weight"] = query_key_rows(key, layer, to_hf=True)
            hf[theirs + "self_attn.v_proj.weight"] = value
            hf[theirs + "self_attn.o_proj.weight"] = source.take(
                ours + "self_attention.linear_proj.weight", (hidden, layer.num_attention_heads * layer.kv_channels))
        if block.mlp.replace_with_linear:
            hf[theirs + "mlp.linear_mlp.weight"] = source.take(ours + "mlp.linear_mlp.weight", (hidden, hidden))
        elif block.mlp.is_mlp:
            width = layer.ffn_hidden_size
            gate_up = source.take(ours + "mlp.linear_fc1.weight", (2 * width, hidden))
            hf[theirs + "mlp.gate_proj.weight"], hf[theirs + "mlp.up_proj.weight"] = split_gate_up(gate_up)
            hf[theirs + "mlp.down_proj.weight"] = source.take(ours + "mlp.linear_fc2.weight", (hidden, width))
    unknown = [name for name in source.tensors
               if name.startswith("decoder.layers.") and not name.endswith(FP8_BUFFER_SUFFIXES)]
    if unknown:
        raise ConversionError(f"the checkpoint's tensors {sorted(unknown)[:4]} have no place in a Hugging Face "
                              f"{NEMOTRON_NAS} built from its block configs; were they written by another model?")
    rest_hf, rest_extras = hf_export_tensors.to_hf_tensors(source.tensors, _without_layers(shape), "LlamaForCausalLM",
                                                           dtype)
    extras.update(rest_extras)
    hf = {name: tensor.to(dtype).contiguous() for name, tensor in hf.items()}
    hf.update(rest_hf)
    return hf, {name: tensor.contiguous() for name, tensor in extras.items()}

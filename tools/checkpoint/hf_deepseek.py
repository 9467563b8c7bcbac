"""DeepseekV3ForCausalLM both ways: which of our models it is, its config.json, and its tensors.

A DeepSeek-V3 model is ours with multi-latent attention (--multi-latent-attention, the latent norms of
--qk-layernorm, no biases), SwiGLU MLPs, `first_k_dense_replace` dense layers and then MoE layers (--moe-layer-freq
[0]*k + [1]*(n - k)) with shared experts and a sigmoid router:

| HF config.json | our flag |
|---|---|
| q_lora_rank (null: `q_proj`), kv_lora_rank | --q-lora-rank, --kv-lora-rank |
| qk_nope_head_dim, qk_rope_head_dim, v_head_dim | --qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim |
| rope_parameters yarn: factor, mscale, mscale_all_dim | --rotary-scaling-factor, --mscale, --mscale-all-dim |
| rope_parameters yarn: original_max_position_embeddings | --original-max-position-embeddings |
| rope_parameters default | --rope-type rope |
| n_routed_experts, num_experts_per_tok | --num-experts, --moe-router-topk |
| moe_intermediate_size, intermediate_size | --moe-ffn-hidden-size, --ffn-hidden-size (dense layers) |
| n_shared_experts | --moe-shared-expert-intermediate-size / --moe-ffn-hidden-size (ungated) |
| n_group, topk_group (1, 1: none) | --moe-router-num-groups, --moe-router-group-topk |
| routed_scaling_factor (1.0: none) | --moe-router-topk-scaling-factor |
| `mlp.gate.e_score_correction_bias` | --moe-router-enable-expert-bias (`mlp.router.expert_bias`; zeros without) |
| num_nextn_predict_layers with `model.layers.{n}.*` present | --mtp-num-layers 1 |

Tensors map one to one (`self_attn.q_a_proj` is `self_attention.linear_q_down_proj`, `q_a_layernorm`
`q_layernorm`, `q_b_proj` `linear_q_up_proj`, `kv_a_proj_with_mqa` `linear_kv_down_proj`, `kv_a_layernorm`
`kv_layernorm`, `kv_b_proj` `linear_kv_up_proj`, `o_proj` `linear_proj`): the head layouts agree (`[q_nope | q_rope]`
and `[k_nope | v]` per head, `[latent | k_rope]`), and both rotate the rope channels as interleaved pairs (2i,
2i + 1) (`rope_interleave`, our regrouped RoPE). A model whose config says `rope_interleave: false` rotates
(i, i + d/2); its q_rope and k_rope rows are permuted on import (and back on export, as the import records it).

What HF computes differently is refused, naming the key or flag: a softmax router, unrenormalised top-k (ours
renormalises the chosen sigmoid scores when k > 1), group scores that are not the sum of each group's best two
(ours: the best topk / group_topk), gated or missing shared experts, biases, an RMSNorm epsilon other than 1e-6 (HF
fixes the latent norms' at 1e-6), YaRN with beta_fast / beta_slow other than 32 / 1 or without truncation.

Multi-token prediction: HF's modeling ignores the layers after `num_hidden_layers`, which DeepSeek's hub files
hold as `model.layers.{n + i}`: a transformer layer plus `enorm`, `hnorm`, `eh_proj` (`[enorm(embedding) ;
hnorm(h)]` -> hidden), `shared_head.norm` (our `final_layernorm`) and copies of the embedding and the output
layer (`embed_tokens`, `shared_head.head`), which ours shares. With one such layer that is our MTP depth 1; how
more depths chain is not fixed by that layout, so more are refused.
"""

import dataclasses
import math
from typing import Dict, Optional

import torch

from hf_errors import ConversionError
from hf_layouts import TensorSource, fuse_gate_up, split_gate_up
from hf_shape import ModelShape

DEEPSEEK_V3, DEEPSEEK_V3_MODEL_TYPE = "DeepseekV3ForCausalLM", "deepseek_v3"
# Training flags the DeepSeek-V3 export checks itself (hf_unsupported refuses them for every other architecture).
EXPORT_FLAGS_CHECKED_HERE = ("multi_latent_attention", "moe_router_score_function", "moe_router_enable_expert_bias",
                             "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor",
                             "mtp_num_layers")
# config.json keys that change nothing our model computes, which an import records and an export writes back.
RECORDED_CONFIG_KEYS = ("num_key_value_heads", "num_nextn_predict_layers", "pretraining_tp", "output_router_logits",
                        "topk_method", "scoring_func", "aux_loss_alpha", "seq_aux", "ep_size", "moe_layer_freq",
                        "rope_interleave")
# HF's latent norms (q_a_layernorm, kv_a_layernorm) always use this epsilon.
LATENT_NORM_EPSILON = 1e-6
# YaRN values our rotary embedding fixes.
YARN_BETA_FAST, YARN_BETA_SLOW, DEFAULT_ORIGINAL_MAX_POSITIONS = 32.0, 1.0, 4096
OWN_FORMATS = "such a model converts between our own formats only (--to torch / --to safetensors)"


def is_deepseek_v3_config(config: dict) -> bool:
    return DEEPSEEK_V3 in (config.get("architectures") or []) or config.get("model_type") == DEEPSEEK_V3_MODEL_TYPE


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def _hf_attention_factor(factor, mscale, mscale_all_dim) -> float:
    """The factor on cos and sin that transformers infers for a yarn config without `attention_factor`."""
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor, 1.0)


# ------------------------------------------------------------------------------------------------------------
# Which models are DeepSeek-V3
# ------------------------------------------------------------------------------------------------------------

def _attention_problems(shape: ModelShape):
    problems = []
    if not shape.multi_latent_attention:
        return [f"no --multi-latent-attention: {DEEPSEEK_V3}'s attention is multi-latent"]
    if not shape.qk_layernorm:
        problems.append("no --qk-layernorm: DeepSeek-V3 normalises its latents (q_a_layernorm, kv_a_layernorm)")
    if shape.position_embedding_type != "rope":
        problems.append(f"--position-embedding-type {shape.position_embedding_type}: DeepSeek-V3 has no position "
                        "embedding table (--position-embedding-type rope)")
    if shape.add_bias_linear or shape.add_qkv_bias:
        problems.append("linear biases (no --disable-bias-linear, or --add-qkv-bias): DeepSeek-V3's linear layers "
                        "have none")
    if shape.normalization != "RMSNorm":
        problems.append(f"--normalization {shape.normalization}: DeepSeek-V3 normalises with RMSNorm")
    if shape.norm_epsilon != LATENT_NORM_EPSILON:
        problems.append(f"--norm-epsilon {shape.norm_epsilon:g}: HF's DeepSeek-V3 fixes its latent norms' epsilon at "
                        f"{LATENT_NORM_EPSILON:g}")
    if not shape.swiglu:
        problems.append("no --swiglu: DeepSeek-V3's MLPs are SwiGLU")
    if shape.rope_type == "rope" and shape.rotary_scaling_factor != 1.0:
        problems.append(f"--rotary-scaling-factor {shape.rotary_scaling_factor:g} with --rope-type rope")
    if shape.apply_residual_connection_post_layernorm:
        problems.append("--apply-residual-connection-post-layernorm: DeepSeek-V3 adds the un-normalised input back")
    return problems


def _moe_problems(shape: ModelShape):
    if not shape.num_experts:
        return [f"no --num-experts: {DEEPSEEK_V3}'s layers after first_k_dense_replace have experts"]
    problems, pattern = [], shape.moe_layers
    dense = pattern.index(True) if any(pattern) else len(pattern)
    if dense == len(pattern) or not all(pattern[dense:]):
        problems.append(f"--moe-layer-freq {shape.moe_layer_freq}: DeepSeek-V3 has first_k_dense_replace dense "
                        "layers, then experts in every layer (at least one)")
    if shape.moe_router_score_function != "sigmoid":
        problems.append(f"--moe-router-score-function {shape.moe_router_score_function}: DeepSeek-V3's router "
                        "scores experts by a sigmoid (--moe-router-score-function sigmoid)")
    shared = shape.moe_shared_expert_intermediate_size
    if not shared or shared % shape.moe_ffn_hidden_size:
        problems.append(f"--moe-shared-expert-intermediate-size {shared}: DeepSeek-V3 has n_shared_experts >= 1 "
                        f"shared experts of --moe-ffn-hidden-size {shape.moe_ffn_hidden_size} each")
    if shape.moe_shared_expert_gate:
        problems.append("--moe-shared-expert-gate: DeepSeek-V3's shared experts are not gated")
    groups, group_topk = shape.moe_router_num_groups, shape.moe_router_group_topk
    if group_topk and group_topk != groups and shape.moe_router_topk // group_topk != 2:
        problems.append(f"--moe-router-topk {shape.moe_router_topk} with --moe-router-group-topk {group_topk}: "
                        "HF scores each group by its best two experts, ours by its best topk / group-topk")
    return problems


def deepseek_problems(shape: ModelShape):
    """What keeps `shape` from being written exactly as a DeepseekV3ForCausalLM (empty when nothing)."""
    problems = _attention_problems(shape)
    if not shape.multi_latent_attention:
        return problems
    problems += _moe_problems(shape)
    if shape.mtp_num_layers and shape.mtp_num_layers != 1:
        problems.append(f"--mtp-num-layers {shape.mtp_num_layers}: the hub layout holds DeepSeek-V3's one "
                        "multi-token prediction layer (model.layers.{num_hidden_layers}); how more depths chain is "
                        "not fixed by it")
    return problems


def check_deepseek_architecture(shape: ModelShape, architecture: str, why: str, other_problems=()) -> str:
    """DEEPSEEK_V3 where `shape` is one exactly; ConversionError listing every flag that keeps it from being one
    (`other_problems`: those the other families' checks found), or, for a model with latent attention, from being
    `architecture`."""
    if architecture != DEEPSEEK_V3:
        raise ConversionError(f"this model cannot be written as a Hugging Face {architecture} ({why}): "
                              f"--multi-latent-attention: only {DEEPSEEK_V3} has latent attention")
    problems = deepseek_problems(shape) + list(other_problems)
    if problems:
        raise ConversionError(f"this model cannot be written as a Hugging Face {DEEPSEEK_V3} ({why}) without "
                              f"changing what it computes: {'; '.join(problems)}; {OWN_FORMATS}")
    return DEEPSEEK_V3


def router_training_flags(shape: ModelShape) -> list:
    """The flags of the sigmoid router's scores, expert bias, groups and scale (none without experts)."""
    if not shape.num_experts:
        return []
    flags = [f"--moe-router-score-function {shape.moe_router_score_function}"]
    if shape.moe_router_enable_expert_bias:
        flags.append("--moe-router-enable-expert-bias")
    if shape.moe_router_num_groups:
        flags.append(f"--moe-router-num-groups {shape.moe_router_num_groups} --moe-router-group-topk "
                     f"{shape.moe_router_group_topk}")
    if shape.moe_router_topk_scaling_factor is not None:
        flags.append(f"--moe-router-topk-scaling-factor {shape.moe_router_topk_scaling_factor:g}")
    return flags


def training_flags(shape: ModelShape) -> list:
    """pretrain_gpt.py's flags for the latent attention, the router and multi-token prediction of `shape`; of a
    hybrid model's experts ('E' layers, Nemotron-H's router) the router's."""
    if not shape.multi_latent_attention:
        return router_training_flags(shape) if "E" in (shape.hybrid_layer_pattern or "") else []
    flags = ["--multi-latent-attention"]
    if shape.q_lora_rank is not None:
        flags.append(f"--q-lora-rank {shape.q_lora_rank}")
    flags.append(f"--kv-lora-rank {shape.kv_lora_rank} --qk-head-dim {shape.qk_head_dim} --qk-pos-emb-head-dim "
                 f"{shape.qk_pos_emb_head_dim} --v-head-dim {shape.v_head_dim}")
    if shape.rope_type == "rope":
        flags.append("--rope-type rope")
    else:
        flags.append(f"--rotary-scaling-factor {shape.rotary_scaling_factor:g} --mscale {shape.mscale:g} "
                     f"--mscale-all-dim {shape.mscale_all_dim:g}")
        if shape.original_max_position_embeddings is not None:
            flags.append(f"--original-max-position-embeddings {shape.original_max_position_embeddings}")
    flags += router_training_flags(shape)
    if shape.mtp_num_layers:
        flags.append(f"--mtp-num-layers {shape.mtp_num_layers}")
    return flags


# ------------------------------------------------------------------------------------------------------------
# config.json
# ------------------------------------------------------------------------------------------------------------

def _rope_parameters(shape: ModelShape) -> dict:
    theta = float(shape.rotary_base)
    if shape.rope_type == "rope":
        return {"rope_type": "default", "rope_theta": theta}
    factor = float(shape.rotary_scaling_factor)
    parameters = {"rope_type": "yarn", "rope_theta": theta, "factor": factor, "mscale": float(shape.mscale),
                  "mscale_all_dim": float(shape.mscale_all_dim), "beta_fast": YARN_BETA_FAST,
                  "beta_slow": YARN_BETA_SLOW, "original_max_position_embeddings":
                  shape.original_max_position_embeddings or DEFAULT_ORIGINAL_MAX_POSITIONS}
    ours = _yarn_mscale(factor, shape.mscale) / _yarn_mscale(factor, shape.mscale_all_dim)
    if ours != _hf_attention_factor(factor, shape.mscale, shape.mscale_all_dim):
        parameters["attention_factor"] = ours  # transformers would infer another from mscale and mscale_all_dim
    return parameters


def deepseek_config(shape: ModelShape, common: dict, recorded: Optional[dict] = None) -> dict:
    """config.json of `shape` as a DeepseekV3ForCausalLM; `common` the keys every architecture has, `recorded`
    the keys an import kept (RECORDED_CONFIG_KEYS)."""
    recorded = recorded or {}
    pattern = shape.moe_layers
    rope = _rope_parameters(shape)
    config = {"model_type": DEEPSEEK_V3_MODEL_TYPE, **common, "hidden_size": shape.hidden_size,
              "intermediate_size": shape.ffn_hidden_size, "moe_intermediate_size": shape.moe_ffn_hidden_size,
              "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_attention_heads,
              "num_key_value_heads": recorded.get("num_key_value_heads", shape.num_attention_heads),
              "n_shared_experts": shape.moe_shared_expert_intermediate_size // shape.moe_ffn_hidden_size,
              "n_routed_experts": shape.num_experts, "num_experts_per_tok": shape.moe_router_topk,
              "routed_scaling_factor": float(shape.moe_router_topk_scaling_factor or 1.0),
              "n_group": shape.moe_router_num_groups or 1, "topk_group": shape.moe_router_group_topk or 1,
              "norm_topk_prob": shape.moe_router_topk > 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
              "first_k_dense_replace": pattern.index(True), "q_lora_rank": shape.q_lora_rank,
              "kv_lora_rank": shape.kv_lora_rank, "qk_nope_head_dim": shape.qk_head_dim,
              "qk_rope_head_dim": shape.qk_pos_emb_head_dim, "v_head_dim": shape.v_head_dim,
              "qk_head_dim": shape.qk_head_dim + shape.qk_pos_emb_head_dim, "head_dim": shape.qk_pos_emb_head_dim,
              "hidden_act": "silu", "max_position_embeddings": shape.max_position_embeddings,
              "rms_norm_eps": shape.norm_epsilon, "rope_theta": rope["rope_theta"],
              "rope_scaling": None if shape.rope_type == "rope" else rope, "rope_parameters": rope,
              "rope_interleave": bool(recorded.get("rope_interleave", True)), "attention_bias": False,
              "attention_dropout": shape.attention_dropout,
              "num_nextn_predict_layers": shape.mtp_num_layers or recorded.get("num_nextn_predict_layers", 0),
              "pretraining_tp": recorded.get("pretraining_tp", 1),
              "output_router_logits": recorded.get("output_router_logits", False)}
    config.update({key: value for key, value in recorded.items() if key not in config})
    return config


def _positive_int(config, key, path, optional=False):
    value = config.get(key)
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConversionError(f"{path}: config.json's {key} ({value!r}) must be a positive integer")
    return value


def _rope_flags(config: dict, path: str) -> dict:
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or parameters
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    theta = scaling.get("rope_theta", parameters.get("rope_theta", config.get("rope_theta", 10000.0)))
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConversionError(f"{path}: partial_rotary_factor {scaling['partial_rotary_factor']}: our latent "
                              "attention rotates all qk_rope_head_dim channels")
    if rope_type == "default":
        return {"rotary_base": theta, "rope_type": "rope"}
    if rope_type != "yarn":
        raise ConversionError(f"{path}: RoPE scaling '{rope_type}' (config.json rope_scaling / rope_parameters): our "
                              "latent attention's rotary embedding is plain ('default', --rope-type rope) or 'yarn'")
    factor = scaling.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise ConversionError(f"{path}: yarn RoPE scaling with factor {factor!r}: it must be a positive number "
                              "(--rotary-scaling-factor)")
    for key, fixed in (("beta_fast", YARN_BETA_FAST), ("beta_slow", YARN_BETA_SLOW), ("truncate", True)):
        if scaling.get(key) not in (None, fixed):
            raise ConversionError(f"{path}: yarn RoPE scaling with {key} {scaling[key]}: our YaRN fixes {key} {fixed}")
    mscale, mscale_all_dim = scaling.get("mscale") or 1.0, scaling.get("mscale_all_dim") or 0.0
    ours = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    theirs = scaling.get("attention_factor")
    theirs = _hf_attention_factor(factor, scaling.get("mscale"), scaling.get("mscale_all_dim")) if theirs is None \
        else theirs
    if not math.isclose(ours, theirs, rel_tol=1e-12):
        raise ConversionError(f"{path}: yarn RoPE scaling scales cos and sin by {theirs:g}, ours (ms(factor, mscale) / "
                              f"ms(factor, mscale_all_dim) = {ours:g}) cannot: set attention_factor or mscale to match")
    original = scaling.get("original_max_position_embeddings")
    return {"rotary_base": theta, "rope_type": "yarn", "rotary_scaling_factor": float(factor),
            "mscale": float(mscale), "mscale_all_dim": float(mscale_all_dim),
            "original_max_position_embeddings": _positive_int({"o": original}, "o", path) if original else None}


def deepseek_flags_of_config(config: dict, path: str, recorded: Optional[dict] = None) -> dict:
    """Our flags (ModelShape fields beyond vocabulary, init std and layernorm-1p) of a DeepSeek-V3 config.json;
    ConversionError naming the key HF computes differently. `recorded`: the extras' megatron_model, if any."""
    recorded = recorded or {}
    hidden, heads = _positive_int(config, "hidden_size", path), _positive_int(config, "num_attention_heads", path)
    layers = _positive_int(config, "num_hidden_layers", path)
    refusals = []
    if config.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers' two names of x * sigmoid(x)
        refusals.append(f"hidden_act '{config['hidden_act']}': our gated MLP is SwiGLU (silu)")
    if config.get("attention_bias"):
        refusals.append("attention_bias true: our latent attention's projections have no biases (but o_proj's, "
                        "which comes with MLP biases)")
    epsilon = config.get("rms_norm_eps", LATENT_NORM_EPSILON)
    if epsilon != LATENT_NORM_EPSILON:
        refusals.append(f"rms_norm_eps {epsilon}: HF's latent norms use {LATENT_NORM_EPSILON:g}, ours --norm-epsilon "
                        "like every norm")
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        refusals.append(f"scoring_func '{config['scoring_func']}': HF's DeepSeek-V3 router takes a sigmoid")
    experts, topk = _positive_int(config, "n_routed_experts", path), _positive_int(config, "num_experts_per_tok", path)
    if topk > experts:
        refusals.append(f"num_experts_per_tok {topk} exceeds n_routed_experts {experts}")
    if bool(config.get("norm_topk_prob", True)) != (topk > 1):
        refusals.append(f"norm_topk_prob {config.get('norm_topk_prob')} with num_experts_per_tok {topk}: our sigmoid "
                        "router renormalises the chosen scores exactly when it chooses more than one")
    groups, group_topk = config.get("n_group") or 1, config.get("topk_group") or 1
    if groups > 1 and group_topk != groups and (topk % group_topk or topk // group_topk != 2):
        refusals.append(f"n_group {groups} with topk_group {group_topk} and num_experts_per_tok {topk}: HF scores "
                        "each group by its best two experts, ours by its best num_experts_per_tok / topk_group")
    shared = config.get("n_shared_experts")
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 1:
        refusals.append(f"n_shared_experts {shared!r}: our DeepSeek-V3 layers have at least one shared expert")
    dense = config.get("first_k_dense_replace", 0)
    if not isinstance(dense, int) or not 0 <= dense < layers:
        refusals.append(f"first_k_dense_replace {dense!r} leaves no layer with experts among {layers}")
    if refusals:
        raise ConversionError(f"{path}: " + "; ".join(refusals))
    width = _positive_int(config, "moe_intermediate_size", path)
    scaling = float(config.get("routed_scaling_factor", 1.0))
    flags = dict(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=heads,
        kv_channels=hidden // heads if hidden % heads == 0 else _positive_int(config, "v_head_dim", path),
        ffn_hidden_size=_positive_int(config, "intermediate_size", path),
        max_position_embeddings=_positive_int(config, "max_position_embeddings", path),
        position_embedding_type="rope", normalization="RMSNorm", norm_epsilon=epsilon, qk_layernorm=True,
        swiglu=True, add_bias_linear=False, rotary_interleaved=recorded.get("rotary_interleaved", False),
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        hidden_dropout=recorded.get("hidden_dropout", 0.0), attention_dropout=config.get("attention_dropout", 0.0),
        num_experts=experts, moe_ffn_hidden_size=width, moe_router_topk=topk,
        moe_layer_freq=1 if dense == 0 else [0] * dense + [1] * (layers - dense),
        moe_shared_expert_intermediate_size=shared * width, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=recorded.get("moe_router_enable_expert_bias", True),
        moe_router_num_groups=groups if groups > 1 else None, moe_router_group_topk=group_topk if groups > 1 else None,
        moe_router_topk_scaling_factor=None if scaling == 1.0 else scaling,
        multi_latent_attention=True, q_lora_rank=_positive_int(config, "q_lora_rank", path, optional=True),
        kv_lora_rank=_positive_int(config, "kv_lora_rank", path),
        qk_head_dim=_positive_int(config, "qk_nope_head_dim", path),
        qk_pos_emb_head_dim=_positive_int(config, "qk_rope_head_dim", path),
        v_head_dim=_positive_int(config, "v_head_dim", path), **_rope_flags(config, path))
    return flags


# ------------------------------------------------------------------------------------------------------------
# Tensors
# ------------------------------------------------------------------------------------------------------------

def _layer_tensors(shape: ModelShape, ours: str, theirs: str, moe: bool):
    """(our name, HF name, shape) of the tensors of one layer that map one to one, and (our SwiGLU fc1 name, HF
    gate name, HF up name, width) of its gated MLPs. Norm weights are those whose shape has one entry."""
    hidden, heads = shape.hidden_size, shape.num_attention_heads
    query_width = heads * (shape.qk_head_dim + shape.qk_pos_emb_head_dim)
    attention, attn = f"{ours}self_attention.", f"{theirs}self_attn."
    plain = [(f"{ours}input_layernorm.weight", f"{theirs}input_layernorm.weight", (hidden,)),
             (f"{ours}pre_mlp_layernorm.weight", f"{theirs}post_attention_layernorm.weight", (hidden,))]
    if shape.q_lora_rank is None:
        plain.append((attention + "linear_q_proj.weight", attn + "q_proj.weight", (query_width, hidden)))
    else:
        rank = shape.q_lora_rank
        plain += [(attention + "linear_q_down_proj.weight", attn + "q_a_proj.weight", (rank, hidden)),
                  (attention + "q_layernorm.weight", attn + "q_a_layernorm.weight", (rank,)),
                  (attention + "linear_q_up_proj.weight", attn + "q_b_proj.weight", (query_width, rank))]
    rank = shape.kv_lora_rank
    plain += [(attention + "linear_kv_down_proj.weight", attn + "kv_a_proj_with_mqa.weight",
               (rank + shape.qk_pos_emb_head_dim, hidden)),
              (attention + "kv_layernorm.weight", attn + "kv_a_layernorm.weight", (rank,)),
              (attention + "linear_kv_up_proj.weight", attn + "kv_b_proj.weight",
               (heads * (shape.qk_head_dim + shape.v_head_dim), rank)),
              (attention + "linear_proj.weight", attn + "o_proj.weight", (hidden, heads * shape.v_head_dim))]
    gated = []
    if not moe:
        plain.append((f"{ours}mlp.linear_fc2.weight", f"{theirs}mlp.down_proj.weight", (hidden, shape.ffn_hidden_size)))
        gated.append((f"{ours}mlp.linear_fc1.weight", f"{theirs}mlp.gate_proj.weight", f"{theirs}mlp.up_proj.weight",
                      shape.ffn_hidden_size))
        return plain, gated
    plain.append((f"{ours}mlp.router.weight", f"{theirs}mlp.gate.weight", (shape.num_experts, hidden)))
    mlps = [(f"{ours}mlp.experts.local_experts.{expert}.", f"{theirs}mlp.experts.{expert}.", shape.moe_ffn_hidden_size)
            for expert in range(shape.num_experts)]
    mlps.append((f"{ours}mlp.shared_experts.", f"{theirs}mlp.shared_experts.",
                 shape.moe_shared_expert_intermediate_size))
    for our_prefix, hf_prefix, width in mlps:
        plain.append((our_prefix + "linear_fc2.weight", hf_prefix + "down_proj.weight", (hidden, width)))
        gated.append((our_prefix + "linear_fc1.weight", hf_prefix + "gate_proj.weight", hf_prefix + "up_proj.weight",
                      width))
    return plain, gated


def _layers(shape: ModelShape):
    """(our prefix, HF prefix, MoE?, MTP?) of every decoder layer, then of the multi-token prediction layers."""
    for index, moe in enumerate(shape.moe_layers):
        yield f"decoder.layers.{index}.", f"model.layers.{index}.", moe, False
    for depth in range(shape.mtp_num_layers or 0):
        yield f"mtp.layers.{depth}.", f"model.layers.{shape.num_layers + depth}.", shape.moe_layers[-1], True


# (our name, HF name) within a multi-token prediction layer, besides its transformer layer.
_MTP_TENSORS = (("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"),
                ("final_layernorm.weight", "shared_head.norm.weight"))


def _rope_rows(rows: torch.Tensor, width: int, rope_dim: int, to_interleaved: bool) -> torch.Tensor:
    """The last `rope_dim` rows of each block of `width` rows, channel i and i + rope_dim / 2 of HF's rotate-half
    layout moved to 2i and 2i + 1 (`to_interleaved`), or back."""
    blocks = rows.reshape(-1, width, *rows.shape[1:]).clone()
    rope = blocks[:, width - rope_dim:]
    halves = (2, rope_dim // 2) if to_interleaved else (rope_dim // 2, 2)
    pairs = rope.reshape(rope.shape[0], *halves, *rope.shape[2:])
    blocks[:, width - rope_dim:] = pairs.transpose(1, 2).reshape(rope.shape)
    return blocks.reshape(rows.shape)


def _with_norms_1p(shape, norms_stored, extras):
    """Norm weights from HF's gamma: gamma - 1 with --apply-layernorm-1p (the recorded value where it still gives
    gamma), gamma otherwise."""
    if not shape.apply_layernorm_1p:
        return norms_stored
    result = {}
    for name, weight in norms_stored.items():
        stored, recorded = weight - 1, extras.get(name)
        if recorded is not None and recorded.shape == weight.shape:
            stored = torch.where(recorded + 1 == weight, recorded, stored)
        result[name] = stored
    return result


def from_hf_tensors(hf_tensors: Dict[str, torch.Tensor], extras: Dict[str, torch.Tensor], shape: ModelShape,
                    where: str, rope_interleave: bool = True, num_nextn_predict_layers: int = 0):
    """(our logical fp32 model tensors, the shape with the multi-token prediction layers the files hold and the
    expert bias they need) of a DeepSeek-V3 directory's tensors."""
    import hf_import_tensors

    hf_tensors = {name: tensor.float() for name, tensor in hf_tensors.items()}
    present = [depth for depth in range(num_nextn_predict_layers or 0)
               if any(name.startswith(f"model.layers.{shape.num_layers + depth}.") for name in hf_tensors)]
    if present and present != [0]:
        raise ConversionError(f"{where}: multi-token prediction layers {[shape.num_layers + d for d in present]}: "
                              "the hub layout holds DeepSeek-V3's one (model.layers.{num_hidden_layers}); how more "
                              "depths chain is not fixed by it")
    bias_names = [f"model.layers.{index}.mlp.gate.e_score_correction_bias"
                  for index, moe in enumerate(shape.moe_layers) if moe]
    bias_names += [f"model.layers.{shape.num_layers}.mlp.gate.e_score_correction_bias"] if present else []
    biased = shape.moe_router_enable_expert_bias or any(
        name in hf_tensors and torch.count_nonzero(hf_tensors[name]) for name in bias_names)
    shape = dataclasses.replace(shape, mtp_num_layers=1 if present else None, moe_router_enable_expert_bias=biased)
    source = TensorSource(hf_tensors, where, "config.json")
    model, norms = {}, {}
    rope_rows = shape.qk_head_dim + shape.qk_pos_emb_head_dim
    for ours, theirs, moe, mtp in _layers(shape):
        layer_ours = ours + "transformer_layer." if mtp else ours
        plain, gated = _layer_tensors(shape, layer_ours, theirs, moe)
        for our_name, hf_name, size in plain:
            tensor = source.take(hf_name, size)
            if not rope_interleave and hf_name.endswith(("q_proj.weight", "q_b_proj.weight")):
                tensor = _rope_rows(tensor, rope_rows, shape.qk_pos_emb_head_dim, to_interleaved=True)
            if not rope_interleave and hf_name.endswith("kv_a_proj_with_mqa.weight"):
                tensor = _rope_rows(tensor, size[0], shape.qk_pos_emb_head_dim, to_interleaved=True)
            (norms if len(size) == 1 else model)[our_name] = tensor
        for our_name, gate, up, width in gated:
            model[our_name] = fuse_gate_up(source.take(gate, (width, shape.hidden_size)),
                                           source.take(up, (width, shape.hidden_size)))
        if moe:
            bias = source.take(f"{theirs}mlp.gate.e_score_correction_bias", (shape.num_experts,))
            if shape.moe_router_enable_expert_bias:
                model[f"{layer_ours}mlp.router.expert_bias"] = bias
        if mtp:
            for our_name, hf_name in _MTP_TENSORS:
                norms[ours + our_name] = source.take(theirs + hf_name, (shape.hidden_size,))
            model[ours + "eh_proj.weight"] = source.take(theirs + "eh_proj.weight",
                                                         (shape.hidden_size, 2 * shape.hidden_size))
            for copy, shared in (("embed_tokens.weight", "model.embed_tokens.weight"),
                                 ("shared_head.head.weight", "lm_head.weight" if
                                  shape.untie_embeddings_and_output_weights else "model.embed_tokens.weight")):
                tensor = source.take(theirs + copy)
                if not torch.equal(tensor, hf_tensors.get(shared, tensor)):
                    raise ConversionError(f"{where}: '{theirs}{copy}' differs from '{shared}', which our multi-token "
                                          "prediction layer shares")
    model.update(_with_norms_1p(shape, norms, extras))
    rest = hf_import_tensors.from_hf_tensors(source.tensors, extras, _without_layers(shape), "LlamaForCausalLM", where)
    model.update(rest)
    return {name: tensor.contiguous() for name, tensor in model.items()}, shape


def _without_layers(shape: ModelShape) -> ModelShape:
    """`shape` without layers or experts: the embeddings, final norm and output layer the generic code maps."""
    return dataclasses.replace(shape, num_layers=0, num_experts=None, moe_layer_freq=1, qk_layernorm=False,
                               add_qkv_bias=False, add_bias_linear=False)


def to_hf_tensors(model: Dict[str, torch.Tensor], shape: ModelShape, dtype: torch.dtype = torch.float32,
                  rope_interleave: bool = True):
    """(HF tensors by HF name in `dtype`, but the fp32 expert-bias buffers; extras by our name in fp32) of our
    fp32 model tensors of a DeepSeek-V3-shaped model; without `rope_interleave` (config.json's, as an import
    recorded it) the rope rows in HF's rotate-half layout."""
    import hf_export_tensors

    source, hf, extras, fp32 = TensorSource(model, "the checkpoint", "its recorded arguments"), {}, {}, set()
    for ours, theirs, moe, mtp in _layers(shape):
        layer_ours = ours + "transformer_layer." if mtp else ours
        plain, gated = _layer_tensors(shape, layer_ours, theirs, moe)
        norms = [(our_name, hf_name, size) for our_name, hf_name, size in plain if len(size) == 1]
        if mtp:
            norms += [(ours + our_name, theirs + hf_name, (shape.hidden_size,)) for our_name, hf_name in _MTP_TENSORS]
            hf[theirs + "eh_proj.weight"] = source.take(ours + "eh_proj.weight",
                                                        (shape.hidden_size, 2 * shape.hidden_size))
        for our_name, hf_name, size in plain:
            if len(size) > 1:
                hf[hf_name] = source.take(our_name, size)
            if not rope_interleave and hf_name.endswith(("q_proj.weight", "q_b_proj.weight")):
                hf[hf_name] = _rope_rows(hf[hf_name], shape.qk_head_dim + shape.qk_pos_emb_head_dim,
                                         shape.qk_pos_emb_head_dim, to_interleaved=False)
            if not rope_interleave and hf_name.endswith("kv_a_proj_with_mqa.weight"):
                hf[hf_name] = _rope_rows(hf[hf_name], size[0], shape.qk_pos_emb_head_dim, to_interleaved=False)
        for our_name, hf_name, size in norms:
            weight = source.take(our_name, size)
            if shape.apply_layernorm_1p:
                extras[our_name], weight = weight, weight + 1
            hf[hf_name] = weight
        for our_name, gate, up, width in gated:
            hf[gate], hf[up] = split_gate_up(source.take(our_name, (2 * width, shape.hidden_size)))
        if moe:
            name = f"{theirs}mlp.gate.e_score_correction_bias"
            hf[name] = (source.take(f"{layer_ours}mlp.router.expert_bias", (shape.num_experts,))
                        if shape.moe_router_enable_expert_bias else torch.zeros(shape.num_experts))
            fp32.add(name)
    layer_names = [name for name in source.tensors if name.startswith(("decoder.layers.", "mtp."))]
    rest = {name: model[name] for name in source.tensors}
    unknown = [name for name in layer_names if not name.endswith((".fp8_amax_history", ".fp8_amax_recorded_count"))]
    if unknown:
        raise ConversionError(f"the checkpoint's tensors {sorted(unknown)[:4]} have no place in a Hugging Face "
                              f"{DEEPSEEK_V3} built from its arguments; were they written by another model?")
    rest_hf, rest_extras = hf_export_tensors.to_hf_tensors(rest, _without_layers(shape), "LlamaForCausalLM", dtype)
    extras.update(rest_extras)
    for depth in range(shape.mtp_num_layers or 0):
        theirs = f"model.layers.{shape.num_layers + depth}."
        hf[theirs + "embed_tokens.weight"] = rest_hf["model.embed_tokens.weight"]
        hf[theirs + "shared_head.head.weight"] = rest_hf.get("lm_head.weight", rest_hf["model.embed_tokens.weight"])
    hf = {name: (tensor.float() if name in fp32 else tensor.to(dtype)).contiguous() for name, tensor in hf.items()}
    hf.update(rest_hf)
    return hf, {name: tensor.contiguous() for name, tensor in extras.items()}


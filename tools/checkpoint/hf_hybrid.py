"""Hybrid Mamba models (pretrain_mamba.py's) as Hugging Face NemotronHForCausalLM and Mamba2ForCausalLM: which of
our models each is, and config.json both ways (the tensors: hf_hybrid_tensors.py).

Both are a stack of blocks `x + mixer(RMSNorm(x))` between the embedding and a final RMSNorm (`backbone.norm_f`).
Nemotron-H's blocks are Mamba-2 mixers, attention, MLPs or Mixture-of-Experts, one per layer as `layers_block_type`
(older configs: `hybrid_override_pattern`) says: our --hybrid-override-pattern, `linear_attention` M,
`full_attention` *, `mlp` -, `moe` E. Its attention has no position embedding (--position-embedding-type none) and
no biases, its MLP is up / down with squared ReLU (`relu2`, --squared-relu). Every Mamba2ForCausalLM block is a
Mamba-2 mixer (pattern M...M).

A `moe` block is our MoE layer: a router `gate` scoring each expert by sigmoid(W x) in fp32, choosing the top
num_experts_per_tok of the scores plus `e_score_correction_bias` (our expert bias, which only chooses) among the
topk_group best of n_group groups (a group scored by its best two), weighting the chosen experts by their scores,
renormalised to sum to 1 (norm_topk_prob) and multiplied by routed_scaling_factor; experts up / down with the
MLP's activation (relu2, as ours with --squared-relu, not gated); plus one shared expert of the same kind on the
block's whole input, added ungated (`n_shared_experts` is not read by transformers; recorded and written back).
With `moe_latent_size` the routed experts work in that width between `fc1_latent_proj` (hidden -> latent, before
them) and `fc2_latent_proj` (latent -> hidden, after the weighted sum), as ours with --moe-latent-size.
transformers computes the router in fp32 whatever the model's dtype: ours with --moe-router-dtype fp32.

| HF config.json | our flag |
|---|---|
| mamba_num_heads (Mamba2: num_heads), mamba_head_dim (head_dim) | --mamba-num-heads, --mamba-head-dim |
| n_groups, ssm_state_size (Mamba2: state_size) | --mamba-num-groups, --mamba-state-dim |
| time_step_min (Mamba2: time_step_limit) | --mamba-dt-limit time_step_min inf (Mamba2: its two bounds) |
| num_attention_heads, num_key_value_heads, head_dim | --num-attention-heads, --num-query-groups, --kv-channels |
| intermediate_size | --ffn-hidden-size |
| layer_norm_epsilon | --norm-epsilon (1e-5: it is also the gated norm's epsilon, which ours fixes) |
| n_routed_experts, num_experts_per_tok | --num-experts, --moe-router-topk (--moe-router-score-function sigmoid) |
| moe_intermediate_size | --moe-ffn-hidden-size |
| moe_shared_expert_intermediate_size | --moe-shared-expert-intermediate-size |
| moe_latent_size (null: none) | --moe-latent-size |
| n_group, topk_group (equal: every group) | --moe-router-num-groups, --moe-router-group-topk |
| routed_scaling_factor (1.0: none) | --moe-router-topk-scaling-factor |
| `mixer.gate.e_score_correction_bias` | --moe-router-enable-expert-bias (`mlp.router.expert_bias`) |
| tie_word_embeddings | no --untie-embeddings-and-output-weights |

HF's mixer computes as ours (megatron/core/ssm/mamba_mixer.py): the same projection, convolution, scan and gated
RMSNorm, normalised over each group's inner / n_groups channels; only the order of in_proj's rows and the
convolution's channels differs (hf_layouts.mamba_rows). What it computes otherwise is refused, naming the key: a
conv_kernel other than 4, in_proj / out_proj biases (`use_bias`), MLP and expert biases (`mlp_bias`), a mixer
activation other than silu, an MLP and expert one other than relu2, norm_topk_prob other than
num_experts_per_tok > 1 (ours renormalises exactly then), group choice our router scores otherwise (topk_group
other than n_group with num_experts_per_tok / topk_group other than 2), multi-token prediction layers and another
layer_norm_epsilon. transformers' Nemotron-H clamps each step softplus(dt) from below at `time_step_min` and Mamba2
to `time_step_limit`: ours with --mamba-dt-limit (a model without it exports with `time_step_min` 0 /
`time_step_limit` [0, inf], which clamp nothing). `chunk_size` changes
rounding only; `use_conv_bias` false reads as zero biases. The keys that change nothing computed are recorded and
written back.
"""

import math
from typing import Optional

from megatron.core.ssm.mamba_config import ATTENTION, MAMBA, MLP, MambaConfigMixin
from megatron.core.ssm.mamba_mixer import GATED_NORM_EPS

from hf_errors import ConversionError
from hf_gpt_oss import gpt_oss_feature_problems
from hf_shape import ModelShape

NEMOTRON_H, MAMBA2 = "NemotronHForCausalLM", "Mamba2ForCausalLM"
HYBRID_MODEL_TYPES = {NEMOTRON_H: "nemotron_h", MAMBA2: "mamba2"}
HYBRID_ARCHITECTURES = tuple(HYBRID_MODEL_TYPES)
CONV_KERNEL = MambaConfigMixin.mamba_conv_kernel  # no flag changes it
EXPERTS = "E"  # Nemotron-H's symbol of a Mixture-of-Experts block
# Nemotron-H's layers_block_type names (and the older ones transformers still reads) of our pattern's symbols.
LAYER_TYPES = {"linear_attention": MAMBA, "mamba": MAMBA, "full_attention": ATTENTION, "attention": ATTENTION,
               "mlp": MLP, "moe": EXPERTS}
WRITTEN_LAYER_TYPES = {MAMBA: "linear_attention", ATTENTION: "full_attention", MLP: "mlp", EXPERTS: "moe"}
# Older Nemotron-H config.json names transformers' NemotronHConfig renames.
LEGACY_NEMOTRON_H_KEYS = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
                          "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max",
                          "mamba_dt_limit": "time_step_limit", "mamba_dt_init_floor": "time_step_floor",
                          "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size"}
# transformers' class defaults of the keys read, for a config.json that omits them.
CONFIG_CLASS_DEFAULTS = {
    NEMOTRON_H: {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 21504,
                 "max_position_embeddings": 4096, "mlp_hidden_act": "relu2", "mlp_bias": False, "ssm_state_size": 128,
                 "mamba_num_heads": 128, "mamba_head_dim": 64, "mamba_hidden_act": "silu", "n_groups": 8,
                 "conv_kernel": 4, "time_step_min": 0.001, "use_conv_bias": True, "use_bias": False,
                 "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
                 "n_routed_experts": 8, "n_shared_experts": 1, "moe_intermediate_size": 7688,
                 "moe_shared_expert_intermediate_size": 7688, "moe_latent_size": None, "num_experts_per_tok": 2,
                 "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "norm_topk_prob": True},
    MAMBA2: {"num_heads": 128, "head_dim": 64, "hidden_size": 4096, "state_size": 128, "num_hidden_layers": 64,
             "layer_norm_epsilon": 1e-5, "expand": 2, "conv_kernel": 4, "n_groups": 8, "use_bias": False,
             "use_conv_bias": True, "hidden_act": "silu", "tie_word_embeddings": False},
}
# config.json keys that change nothing our model computes (initialisation, kernels, caches, the MoE shapes of a
# model without 'moe' blocks, the multi-token prediction shapes, Nemotron-H's sliding_window, which its attention
# does not read), which an import records and an export writes back (where it does not compute them itself).
RECORDED_CONFIG_KEYS = (
    "expand", "chunk_size", "residual_in_fp32", "rescale_prenorm_residual", "time_step_min", "time_step_max",
    "time_step_floor", "time_step_limit", "time_step_rank", "use_conv_bias", "mamba_proj_bias", "mamba_ssm_cache_dtype",
    "num_logits_to_keep", "use_mamba_kernels", "attention_bias", "sliding_window", "n_routed_experts",
    "n_shared_experts", "moe_intermediate_size", "moe_shared_expert_intermediate_size", "moe_latent_size",
    "moe_shared_expert_overlap", "num_experts_per_tok", "routed_scaling_factor", "n_group", "topk_group",
    "norm_topk_prob", "output_router_logits", "mtp_layers_block_type")
# Mamba2's config.json has no context length (nothing it computes depends on one): the --max-position-embeddings
# of an import, which then only bounds --seq-length.
MAMBA2_MAX_POSITIONS = 4096
OWN_FORMATS = "such a model converts between our own formats only (--to torch / --to safetensors)"


def hybrid_architecture_of_config(config: dict) -> Optional[str]:
    """NEMOTRON_H or MAMBA2 for their config.json, else None."""
    names = config.get("architectures") or []
    for architecture, model_type in HYBRID_MODEL_TYPES.items():
        if architecture in names or config.get("model_type") == model_type:
            return architecture
    return None


def with_class_defaults(config: dict, architecture: str) -> dict:
    """config.json with transformers' class defaults for what it omits and the older Nemotron-H names renamed."""
    config = dict(config)
    if architecture == NEMOTRON_H:
        for old, new in LEGACY_NEMOTRON_H_KEYS.items():
            if old in config:
                config.setdefault(new, config.pop(old))
    return {**CONFIG_CLASS_DEFAULTS[architecture], **config}


def uses_conv_bias(config: dict, architecture: str) -> bool:
    return bool(with_class_defaults(config, architecture)["use_conv_bias"])


# ------------------------------------------------------------------------------------------------------------
# Which models are Nemotron-H or Mamba2
# ------------------------------------------------------------------------------------------------------------

def _block_problems(shape: ModelShape, architecture: str) -> list:
    """What keeps the attention and MLP layers of `shape` from being Nemotron-H's."""
    problems = []
    if shape.layers_marked(ATTENTION):
        if shape.qk_layernorm:
            problems.append(f"--qk-layernorm: {architecture}'s attention does not normalise query and key heads")
        if shape.multi_latent_attention:
            problems.append(f"--multi-latent-attention: {architecture}'s attention has q / k / v projections")
        if shape.position_embedding_type != "none":
            problems.append(f"--position-embedding-type {shape.position_embedding_type}: {architecture}'s "
                            "attention has no position embedding (--position-embedding-type none)")
    mlps = shape.layers_marked(MLP) or shape.layers_marked(EXPERTS)
    if mlps and (shape.swiglu or shape.openai_gelu or not shape.squared_relu):
        activation = "--swiglu" if shape.swiglu else "--openai-gelu" if shape.openai_gelu else "the GeLU MLP"
        problems.append(f"{activation}: {architecture}'s MLP layers and experts apply squared ReLU (--squared-relu)")
    if (shape.layers_marked(ATTENTION) or mlps) and (shape.add_bias_linear or shape.add_qkv_bias):
        problems.append(f"linear biases (no --disable-bias-linear, or --add-qkv-bias): {architecture}'s attention "
                        "layers have none (our MLP layers' and experts' come only with theirs)")
    return problems


def _expert_problems(shape: ModelShape, architecture: str) -> list:
    """What keeps the Mixture-of-Experts layers ('E') of `shape` from being Nemotron-H's `moe` blocks."""
    if architecture != NEMOTRON_H or not shape.num_experts:
        return []
    problems = []
    if shape.moe_router_score_function != "sigmoid":
        problems.append(f"--moe-router-score-function {shape.moe_router_score_function}: {NEMOTRON_H}'s router "
                        "scores experts by a sigmoid (--moe-router-score-function sigmoid)")
    if not shape.moe_shared_expert_intermediate_size:
        problems.append(f"no --moe-shared-expert-intermediate-size: every {NEMOTRON_H} 'moe' block adds a shared "
                        "expert")
    if shape.moe_shared_expert_gate:
        problems.append(f"--moe-shared-expert-gate: {NEMOTRON_H}'s shared expert is not gated")
    groups, group_topk = shape.moe_router_num_groups, shape.moe_router_group_topk
    if group_topk and group_topk != groups and shape.moe_router_topk // group_topk != 2:
        problems.append(f"--moe-router-topk {shape.moe_router_topk} with --moe-router-group-topk {group_topk}: "
                        f"{NEMOTRON_H} scores each group by its best two experts, ours by its best topk / group-topk")
    return problems


def hybrid_problems(shape: ModelShape, architecture: str) -> list:
    """What keeps `shape` from being written exactly as `architecture` (NEMOTRON_H or MAMBA2; empty when nothing)."""
    pattern = shape.hybrid_layer_pattern
    if pattern is None:
        return [f"no --hybrid-override-pattern: {architecture}'s layers are Mamba, attention or MLP layers, each "
                "on its own (pretrain_mamba.py's hybrid model)"]
    problems = []
    if architecture == MAMBA2 and set(pattern) != {MAMBA}:
        problems.append(f"--hybrid-override-pattern {pattern}: every {MAMBA2} layer is a Mamba layer "
                        f"({NEMOTRON_H} has attention and MLP layers too)")
    if architecture == MAMBA2 and shape.mamba_inner_size % shape.hidden_size:
        problems.append(f"--mamba-num-heads {shape.mamba_heads} x --mamba-head-dim {shape.mamba_head_dim} is not a "
                        f"multiple of --hidden-size {shape.hidden_size}: {MAMBA2}'s inner width is expand x "
                        "hidden_size")
    if shape.position_embedding_type == "learned_absolute":
        problems.append(f"--position-embedding-type learned_absolute: {architecture} has no position embedding "
                        "table (--position-embedding-type none)")
    if shape.normalization != "RMSNorm":
        problems.append(f"--normalization {shape.normalization}: {architecture} normalises with RMSNorm")
    if shape.norm_epsilon != GATED_NORM_EPS:
        problems.append(f"--norm-epsilon {shape.norm_epsilon:g}: {architecture}'s one layer_norm_epsilon is also "
                        f"its Mamba mixers' gated-norm epsilon, which ours fixes at {GATED_NORM_EPS:g}")
    if shape.apply_residual_connection_post_layernorm:
        problems.append(f"--apply-residual-connection-post-layernorm: {architecture} adds the un-normalised input "
                        "back")
    if architecture == NEMOTRON_H and shape.mamba_dt_limit is not None and shape.mamba_dt_limit[1] != math.inf:
        problems.append(f"--mamba-dt-limit {shape.mamba_dt_limit[0]:g} {shape.mamba_dt_limit[1]:g}: {NEMOTRON_H} "
                        "clamps the step from below only (time_step_min)")
    return (problems + _block_problems(shape, architecture) + _expert_problems(shape, architecture)
            + gpt_oss_feature_problems(shape, architecture))


def default_hybrid_architecture(shape: ModelShape) -> str:
    """Mamba2ForCausalLM for Mamba layers only whose inner width is a multiple of the hidden size, else Nemotron-H."""
    only_mamba = set(shape.hybrid_layer_pattern or "") == {MAMBA}
    return MAMBA2 if only_mamba and shape.mamba_inner_size % shape.hidden_size == 0 else NEMOTRON_H


def check_hybrid_architecture(shape: ModelShape, architecture: str, why: str) -> str:
    """`architecture` where `shape` is exactly one; ConversionError listing every flag in the way. `architecture`
    may be a non-hybrid one asked for a hybrid model, which is refused."""
    if architecture not in HYBRID_ARCHITECTURES:
        raise ConversionError(f"this model cannot be written as a Hugging Face {architecture} ({why}): "
                              f"--hybrid-override-pattern {shape.hybrid_layer_pattern}: only {NEMOTRON_H} and "
                              f"{MAMBA2} have Mamba, attention and MLP layers on their own; {OWN_FORMATS}")
    problems = hybrid_problems(shape, architecture)
    if problems:
        raise ConversionError(f"this model cannot be written as a Hugging Face {architecture} ({why}) without "
                              f"changing what it computes: {'; '.join(problems)}; {OWN_FORMATS}")
    return architecture


# ------------------------------------------------------------------------------------------------------------
# config.json
# ------------------------------------------------------------------------------------------------------------

def hybrid_config(shape: ModelShape, architecture: str, common: dict, recorded: Optional[dict] = None) -> dict:
    """config.json of `shape` as `architecture`; `common` the keys every architecture has, `recorded` the keys an
    import kept (RECORDED_CONFIG_KEYS)."""
    recorded = recorded or {}
    low, high = shape.mamba_dt_limit or (0.0, math.inf)
    mixer = {"n_groups": shape.mamba_num_groups, "conv_kernel": CONV_KERNEL, "use_bias": False,
             "use_conv_bias": bool(recorded.get("use_conv_bias", True)), "layer_norm_epsilon": shape.norm_epsilon,
             "chunk_size": recorded.get("chunk_size", MambaConfigMixin.mamba_chunk_size),
             "expand": recorded.get("expand", max(1, shape.mamba_inner_size // shape.hidden_size))}
    if architecture == MAMBA2:
        config = {"model_type": HYBRID_MODEL_TYPES[MAMBA2], **common, "hidden_size": shape.hidden_size,
                  "num_hidden_layers": shape.num_layers, "num_heads": shape.mamba_heads,
                  "head_dim": shape.mamba_head_dim, "state_size": shape.mamba_state_dim, "hidden_act": "silu",
                  **mixer, "expand": shape.mamba_inner_size // shape.hidden_size,
                  "time_step_limit": _written_step_limit(recorded, low, high)}
    else:
        pattern = shape.hybrid_layer_pattern
        config = {"model_type": HYBRID_MODEL_TYPES[NEMOTRON_H], **common, "hidden_size": shape.hidden_size,
                  "layers_block_type": [WRITTEN_LAYER_TYPES[symbol] for symbol in pattern],
                  "hybrid_override_pattern": pattern, "num_attention_heads": shape.num_attention_heads,
                  "num_key_value_heads": shape.num_query_groups, "head_dim": shape.kv_channels,
                  "intermediate_size": shape.ffn_hidden_size, "max_position_embeddings": shape.max_position_embeddings,
                  "attention_dropout": shape.attention_dropout, "hidden_dropout": shape.hidden_dropout,
                  "mlp_hidden_act": "relu2", "mlp_bias": False, "mamba_num_heads": shape.mamba_heads,
                  "mamba_head_dim": shape.mamba_head_dim, "ssm_state_size": shape.mamba_state_dim,
                  "mamba_hidden_act": "silu", **mixer, "time_step_min": low, "num_nextn_predict_layers": 0}
        if EXPERTS in pattern:
            config.update(_experts_config(shape, recorded))
    config.update({key: value for key, value in recorded.items() if key not in config})
    return config


def _experts_config(shape: ModelShape, recorded: dict) -> dict:
    """Nemotron-H's expert keys of the 'E' layers of `shape`. Without group-limited routing n_group and
    topk_group are the recorded ones where they choose every group, else 1."""
    groups, group_topk = shape.moe_router_num_groups, shape.moe_router_group_topk
    if not group_topk:
        groups = group_topk = recorded.get("n_group", 1) if recorded.get("n_group") == recorded.get("topk_group") else 1
    return {"n_routed_experts": shape.num_experts, "num_experts_per_tok": shape.moe_router_topk,
            "moe_intermediate_size": shape.moe_ffn_hidden_size,
            "moe_shared_expert_intermediate_size": shape.moe_shared_expert_intermediate_size,
            "n_shared_experts": recorded.get("n_shared_experts", 1), "moe_latent_size": shape.moe_latent_size,
            "routed_scaling_factor": float(shape.moe_router_topk_scaling_factor or 1.0), "n_group": groups,
            "topk_group": group_topk, "norm_topk_prob": shape.moe_router_topk > 1}


def _pattern_of_config(config: dict, path: str) -> str:
    """Our pattern of Nemotron-H's layers_block_type (or hybrid_override_pattern), 'E' for expert blocks."""
    types = config.get("layers_block_type") or config.get("layer_types")
    if types is None:
        pattern = config.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern:
            raise ConversionError(f"{path}: config.json has neither layers_block_type nor hybrid_override_pattern")
        types = pattern
    unknown = sorted({str(kind) for kind in types} - set(LAYER_TYPES) - set(LAYER_TYPES.values()))
    if unknown:
        raise ConversionError(f"{path}: layer types {unknown} in config.json's layers_block_type / "
                              f"hybrid_override_pattern: ours are {', '.join(WRITTEN_LAYER_TYPES.values())} "
                              f"({MAMBA}, {ATTENTION}, {MLP}, {EXPERTS})")
    return "".join(LAYER_TYPES.get(kind, kind) for kind in types)


def _positive_int(config, key, path):
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConversionError(f"{path}: config.json's {key} ({value!r}) must be a positive integer")
    return value


def _step_limit(limit) -> tuple:
    """time_step_limit as two floats; transformers writes infinity as {"__float__": "Infinity"}."""
    def number(value):
        return float(value["__float__"]) if isinstance(value, dict) and "__float__" in value else float(value)

    return tuple(number(value) for value in limit)


def _written_step_limit(recorded: dict, low: float, high: float):
    """Mamba2's time_step_limit as the import recorded it when it says the same, else [low, high]."""
    if "time_step_limit" in recorded and _step_limit(recorded["time_step_limit"]) == (low, high):
        return recorded["time_step_limit"]
    return [low, high]


def _dt_limit_of_config(config: dict, architecture: str, pattern: str) -> Optional[tuple]:
    """--mamba-dt-limit of the clamp transformers applies to each step (None: it clamps nothing)."""
    if MAMBA not in pattern:
        return None
    if architecture == MAMBA2:
        low, high = _step_limit(config.get("time_step_limit", (0.0, math.inf)))
    else:
        low, high = float(config["time_step_min"]), math.inf
    return None if (low, high) == (0.0, math.inf) else (low, high)


def _expert_refusals(config: dict) -> list:
    """What in Nemotron-H's expert keys our MoE layer does not compute."""
    refusals = []
    latent = config["moe_latent_size"]
    if latent is not None and (isinstance(latent, bool) or not isinstance(latent, int) or latent <= 0):
        refusals.append(f"config.json's moe_latent_size ({latent!r}) must be a positive integer or null")
    experts, topk = config["n_routed_experts"], config["num_experts_per_tok"]
    for key, value in (("n_routed_experts", experts), ("num_experts_per_tok", topk),
                       ("moe_intermediate_size", config["moe_intermediate_size"]),
                       ("moe_shared_expert_intermediate_size", config["moe_shared_expert_intermediate_size"]),
                       ("n_group", config["n_group"]), ("topk_group", config["topk_group"])):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            return refusals + [f"config.json's {key} ({value!r}) must be a positive integer"]
    if topk > experts:
        refusals.append(f"num_experts_per_tok {topk} exceeds n_routed_experts {experts}")
    if bool(config["norm_topk_prob"]) != (topk > 1):
        refusals.append(f"norm_topk_prob {config['norm_topk_prob']} with num_experts_per_tok {topk}: our sigmoid "
                        "router renormalises the chosen scores exactly when it chooses more than one")
    groups, group_topk = config["n_group"], config["topk_group"]
    if experts % groups or group_topk > groups:
        refusals.append(f"n_group {groups} with topk_group {group_topk}: HF's router needs n_routed_experts "
                        f"{experts} in n_group equal groups and at most n_group of them chosen")
    elif group_topk != groups and (topk % group_topk or topk // group_topk != 2):
        refusals.append(f"n_group {groups} with topk_group {group_topk} and num_experts_per_tok {topk}: HF scores "
                        "each group by its best two experts, ours by its best num_experts_per_tok / topk_group")
    return refusals


def _mixer_refusals(config: dict, architecture: str, pattern: str) -> list:
    refusals = []
    if config["conv_kernel"] != CONV_KERNEL:
        refusals.append(f"conv_kernel {config['conv_kernel']}: our Mamba mixer's convolution is {CONV_KERNEL} wide")
    if config["use_bias"]:
        refusals.append("use_bias true: our Mamba mixer's in_proj and out_proj have no biases")
    activation_key = "hidden_act" if architecture == MAMBA2 else "mamba_hidden_act"
    if config[activation_key] not in ("silu", "swish"):
        refusals.append(f"{activation_key} '{config[activation_key]}': our Mamba mixer applies silu")
    if config["layer_norm_epsilon"] != GATED_NORM_EPS:
        refusals.append(f"layer_norm_epsilon {config['layer_norm_epsilon']}: it is also the Mamba mixer's gated-norm "
                        f"epsilon, which ours fixes at {GATED_NORM_EPS:g}")
    if architecture == MAMBA2:
        return refusals
    if EXPERTS in pattern:
        refusals += _expert_refusals(config)
    if config["mlp_bias"]:
        refusals.append("mlp_bias true: our MLP layers and experts have biases only with the attention layers' "
                        "(no --disable-bias-linear), which Nemotron-H's attention never has")
    if (MLP in pattern or EXPERTS in pattern) and config["mlp_hidden_act"] != "relu2":
        refusals.append(f"mlp_hidden_act '{config['mlp_hidden_act']}': our non-gated MLP and experts are squared "
                        "ReLU ('relu2', --squared-relu)")
    if config["num_nextn_predict_layers"]:
        refusals.append(f"num_nextn_predict_layers {config['num_nextn_predict_layers']}: our hybrid model has no "
                        "multi-token prediction layers")
    return refusals


def _expert_flags(config: dict, pattern: str, recorded: dict) -> dict:
    """The MoE ModelShape fields of Nemotron-H's expert keys (checked by _expert_refusals); the MoE layers are the
    pattern's 'E' layers (--moe-layer-freq as training derives it)."""
    groups, group_topk, scaling = config["n_group"], config["topk_group"], float(config["routed_scaling_factor"])
    limited = group_topk != groups
    return dict(num_experts=config["n_routed_experts"], moe_ffn_hidden_size=config["moe_intermediate_size"],
                moe_layer_freq=[int(symbol == EXPERTS) for symbol in pattern],
                moe_router_topk=config["num_experts_per_tok"],
                moe_shared_expert_intermediate_size=config["moe_shared_expert_intermediate_size"],
                moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=recorded.get("moe_router_enable_expert_bias", True),
                moe_router_num_groups=groups if limited else None,
                moe_router_group_topk=group_topk if limited else None,
                moe_router_topk_scaling_factor=None if scaling == 1.0 else scaling,
                moe_latent_size=config["moe_latent_size"])


def hybrid_flags_of_config(config: dict, architecture: str, path: str, recorded: Optional[dict] = None) -> dict:
    """The ModelShape fields (but the vocabulary, init std and layernorm-1p) of a Nemotron-H or Mamba2 config.json;
    ConversionError naming every key our model cannot compute as HF does. `recorded`: the extras' megatron_model."""
    recorded = recorded or {}
    config = with_class_defaults(config, architecture)
    hidden = _positive_int(config, "hidden_size", path)
    if architecture == MAMBA2:
        layers = _positive_int(config, "num_hidden_layers", path)
        pattern = MAMBA * layers
        heads, head_dim = _positive_int(config, "num_heads", path), _positive_int(config, "head_dim", path)
        state = _positive_int(config, "state_size", path)
    else:
        pattern = _pattern_of_config(config, path)
        heads, head_dim = _positive_int(config, "mamba_num_heads", path), _positive_int(config, "mamba_head_dim", path)
        state = _positive_int(config, "ssm_state_size", path)
    groups = _positive_int(config, "n_groups", path)
    refusals = _mixer_refusals(config, architecture, pattern)
    if heads % groups:
        refusals.append(f"{'num_heads' if architecture == MAMBA2 else 'mamba_num_heads'} {heads} is not a multiple "
                        f"of n_groups {groups}")
    if architecture == MAMBA2 and config["expand"] * hidden != heads * head_dim:
        refusals.append(f"expand {config['expand']} x hidden_size {hidden} differs from num_heads {heads} x "
                        f"head_dim {head_dim}: transformers' Mamba2 requires them equal")
    if refusals:
        raise ConversionError(f"{path}: " + "; ".join(refusals))
    values = dict(num_layers=len(pattern), hidden_size=hidden, normalization="RMSNorm",
                  mamba_dt_limit=_dt_limit_of_config(config, architecture, pattern),
                  norm_epsilon=config["layer_norm_epsilon"], add_bias_linear=False,
                  untie_embeddings_and_output_weights=not config["tie_word_embeddings"],
                  position_embedding_type="none", hybrid_layer_pattern=pattern, mamba_state_dim=state,
                  mamba_head_dim=head_dim, mamba_num_groups=groups, mamba_num_heads=heads)
    if architecture == MAMBA2:  # no attention or MLP layers: the recorded shape's, else one head of hidden_size
        return {**values, "num_attention_heads": recorded.get("num_attention_heads", 1),
                "num_query_groups": recorded.get("num_query_groups", 1),
                "kv_channels": recorded.get("kv_channels", hidden),
                "ffn_hidden_size": recorded.get("ffn_hidden_size", 4 * hidden),
                "max_position_embeddings": recorded.get("max_position_embeddings", MAMBA2_MAX_POSITIONS),
                "hidden_dropout": recorded.get("hidden_dropout", 0.0)}
    attention_heads = _positive_int(config, "num_attention_heads", path)
    if EXPERTS in pattern:
        values.update(_expert_flags(config, pattern, recorded))
    return {**values, "num_attention_heads": attention_heads,
            "num_query_groups": config.get("num_key_value_heads") or attention_heads,
            "kv_channels": config.get("head_dim") or hidden // attention_heads,
            "ffn_hidden_size": _positive_int(config, "intermediate_size", path),
            "max_position_embeddings": _positive_int(config, "max_position_embeddings", path), "squared_relu": True,
            "hidden_dropout": recorded.get("hidden_dropout", config.get("hidden_dropout", 0.0)),
            "attention_dropout": config.get("attention_dropout", 0.0)}


"""gpt-oss (Hugging Face GptOssForCausalLM) both ways: which of our models it is, its config.json and the tensors
of one layer.

A gpt-oss layer is a Llama layer (RMSNorm, grouped-query attention with rotate-half RoPE, q / k / v / o biases
per `attention_bias`: ours without --disable-bias-linear) with three additions, each one of our flags:

- attention sinks: `self_attn.sinks` `[heads]`, one logit per head added to the softmax's denominator, is
  --softmax-type learnable's `self_attention.softmax_offset`;
- sliding-window attention in the layers `layer_types` marks "sliding_attention": HF's query i sees key j when
  i - sliding_window < j <= i, which is our --window-size (sliding_window - 1, 0); the layers are
  --window-attn-skip-freq 2 for HF's alternation (layer 0 windowed, layer 1 not, ...), else a 0/1 list;
- every MLP is a Mixture-of-Experts layer. The router `mlp.router.weight` `[E, hidden]` takes the softmax of the
  top-k logits (ours without --moe-router-pre-softmax). The experts of a layer are packed: `mlp.experts.gate_up_proj`
  `[E, hidden, 2 * ffn]` (applied as x @ W) with gate and up interleaved along the last dimension, gate first,
  `gate_up_proj_bias` `[E, 2 * ffn]`, `down_proj` `[E, ffn, hidden]`, `down_proj_bias` `[E, hidden]`. Their
  activation is (clamp(up, -l, l) + 1) * g * sigmoid(1.702 g) with g = min(gate, l), l = `swiglu_limit`:
  --quick-geglu --activation-func-clamp-value l --glu-linear-offset 1. Our fc1 rows interleave gate and up in the
  same way, so expert e's linear_fc1 weight is gate_up_proj[e] transposed and its linear_fc2 weight down_proj[e]
  transposed, under its global index.

HF's router has a bias, `mlp.router.bias` `[E]`: ours with --moe-router-bias (`mlp.router.bias`), which an import
sets whenever the model has linear biases (`attention_bias`, as upstream's rule); without them a router bias must
be zero (the export writes zeros). HF's gpt-oss rotates with YaRN by default (`rope_parameters` / `rope_scaling`
rope_type "yarn"; transformers' defaults when config.json has neither): --position-embedding-type yarn, with factor
as --yarn-rotary-scaling-factor, original_max_position_embeddings, beta_fast and beta_slow as the --yarn-* flags of
those names, `truncate` as --[no-]yarn-correction-range-round-to-int and mscale / mscale_all_dim (when both are
given) as --yarn-mscale / --yarn-mscale-all-dim (hf_rope.py); HF multiplies cos and sin by the attention factor,
as our attention does. Plain RoPE, 'linear' and 'llama3' read as for Llama. MXFP4-quantized directories
(`quantization_config`) are refused before (hf_unsupported.py).
"""

from typing import Dict, Optional

import torch
from megatron.core.activations import QUICK_GELU_ALPHA
from megatron.core.transformer.attention_variants import window_layer_pattern

from hf_errors import ConversionError
from hf_rope import hf_rope_config, hf_yarn_rope_config, rope_flags_of_config, yarn_flags_of_scaling

GPT_OSS, GPT_OSS_MODEL_TYPE = "GptOssForCausalLM", "gpt_oss"
SLIDING, FULL = "sliding_attention", "full_attention"
# The training-only keys of config.json and transformers' defaults, for a model that was not imported.
_TRAINING_ONLY_DEFAULTS = {"router_aux_loss_coef": 0.001, "output_router_logits": False}
# transformers' GptOssConfig rotary embedding when config.json gives none, and its default rope_theta.
DEFAULT_ROPE_PARAMETERS = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                           "original_max_position_embeddings": 4096}
DEFAULT_ROPE_THETA = 150000.0
# transformers' GptOssForCausalLM builds the sliding-window mask even when no layer uses it, so config.json needs a
# sliding_window: the imported one (recorded), else GptOssConfig's default.
RECORDED_CONFIG_KEYS = ("sliding_window",)
DEFAULT_SLIDING_WINDOW = 128


def _alternating(num_layers: int) -> list:
    """HF's default layer_types as one bool per layer (True: windowed), which --window-attn-skip-freq 2 gives."""
    return window_layer_pattern((0, 0), 2, num_layers)


def _window_of(shape):
    """Our window as (HF sliding_window or None, one bool per layer)."""
    pattern = window_layer_pattern(shape.window_size, shape.window_attn_skip_freq, shape.num_layers)
    return (shape.window_size[0] + 1 if any(pattern) else None), pattern


def gpt_oss_problems(shape) -> list:
    """The flags that keep our model from being written as a GptOssForCausalLM exactly (empty: none)."""
    problems = []
    if shape.position_embedding_type not in ("rope", "yarn"):
        problems.append(f"--position-embedding-type {shape.position_embedding_type}: gpt-oss rotates "
                        "(--position-embedding-type yarn or rope)")
    if shape.rotary_percent != 1.0:
        problems.append(f"--rotary-percent {shape.rotary_percent}: gpt-oss rotates every channel of a head")
    if shape.use_rope_scaling and shape.rotary_seq_len_interpolation_factor is not None:
        problems.append(f"--rotary-seq-len-interpolation-factor {shape.rotary_seq_len_interpolation_factor} with "
                        "--use-rope-scaling: config.json holds one RoPE scaling ('linear' or 'llama3')")
    if shape.normalization != "RMSNorm":
        problems.append(f"--normalization {shape.normalization}: gpt-oss normalises with RMSNorm")
    if shape.qk_layernorm:
        problems.append("--qk-layernorm: gpt-oss does not normalise query and key heads")
    if not shape.add_bias_linear and shape.add_qkv_bias:
        problems.append("--add-qkv-bias with --disable-bias-linear: gpt-oss's attention has biases on q, k, v and o "
                        "(`attention_bias`) or none")
    if not shape.quick_geglu:
        problems.append("no --quick-geglu: gpt-oss's experts gate with quick GeLU, x * sigmoid(1.702 x)")
    if shape.activation_func_clamp_value is None:
        problems.append("no --activation-func-clamp-value: gpt-oss clamps the gate and up projections "
                        "(`swiglu_limit`, 7.0 in the released models)")
    if shape.glu_linear_offset != 1.0:
        problems.append(f"--glu-linear-offset {shape.glu_linear_offset}: gpt-oss multiplies by up + 1 "
                        "(--glu-linear-offset 1)")
    if shape.softmax_type != "learnable":
        problems.append(f"--softmax-type {shape.softmax_type}: gpt-oss's attention has a learned sink per head "
                        "(--softmax-type learnable)")
    if shape.window_size is not None:
        left, right = shape.window_size
        if left < 0 or right > 0:
            problems.append(f"--window-size {shape.window_size}: gpt-oss's window looks back a fixed number of "
                            "positions and not ahead, (W - 1, 0) for its sliding_window W")
    if not shape.num_experts:
        problems.append("no --num-experts: every gpt-oss layer has experts")
    else:
        if not all(shape.moe_layers):
            problems.append(f"--moe-layer-freq {shape.moe_layer_freq}: every gpt-oss layer has experts")
        if shape.moe_router_pre_softmax:
            problems.append("--moe-router-pre-softmax: gpt-oss's router takes the softmax of the top-k logits")
        if shape.moe_shared_expert_intermediate_size:
            problems.append(f"--moe-shared-expert-intermediate-size {shape.moe_shared_expert_intermediate_size}: "
                            "gpt-oss has no shared expert")
    return problems


def gpt_oss_feature_problems(shape, architecture: str) -> list:
    """The gpt-oss flags of our model that `architecture` (any other) cannot compute."""
    where = "(GptOssForCausalLM"
    problems = []
    if shape.quick_geglu:
        problems.append(f"--quick-geglu: {architecture}'s MLP is not quick GeGLU {where}'s is)")
    for flag, value, unset in (("--activation-func-clamp-value", shape.activation_func_clamp_value, None),
                               ("--glu-linear-offset", shape.glu_linear_offset, 0.0)):
        if value != unset:
            problems.append(f"{flag} {value}: {architecture}'s MLP computes act(gate) * up unclamped {where}'s "
                            "clamps and adds 1)")
    if shape.softmax_type != "vanilla":
        problems.append(f"--softmax-type {shape.softmax_type}: {architecture}'s attention has no sinks {where}'s "
                        "are --softmax-type learnable)")
    if shape.window_size is not None:
        problems.append(f"--window-size {shape.window_size}: {architecture} attends to every earlier position "
                        f"{where} has sliding-window layers)")
    if shape.moe_router_bias:
        problems.append(f"--moe-router-bias: {architecture}'s router has no bias {where}'s has)")
    return problems


def gpt_oss_training_flags(shape) -> list:
    """pretrain_gpt.py's gpt-oss flags of `shape` (none for another model)."""
    flags = ["--quick-geglu"] if shape.quick_geglu else []
    if shape.moe_router_bias:
        flags.append("--moe-router-bias")
    if shape.activation_func_clamp_value is not None:
        flags.append(f"--activation-func-clamp-value {shape.activation_func_clamp_value:g}")
    if shape.glu_linear_offset:
        flags.append(f"--glu-linear-offset {shape.glu_linear_offset:g}")
    if shape.softmax_type != "vanilla":
        flags.append(f"--softmax-type {shape.softmax_type}")
    if shape.window_size is not None:
        flags.append(f"--window-size {shape.window_size[0]},{shape.window_size[1]}")
        freq = shape.window_attn_skip_freq
        if isinstance(freq, int):
            flags.append(f"--window-attn-skip-freq {freq}")
        elif freq is not None:
            flags.append("--window-attn-skip-freq [" + ",".join(str(int(flag)) for flag in freq) + "]")
    return flags


def gpt_oss_config(shape, common: dict, recorded_keys: Optional[dict] = None) -> dict:
    """config.json of the GptOssForCausalLM of `shape`; `common`: the keys every architecture writes;
    `recorded_keys`: the keys an import kept (its training-only ones and sliding_window)."""
    recorded_keys = recorded_keys or {}
    sliding_window, pattern = _window_of(shape)
    if sliding_window is None:  # no layer uses it
        sliding_window = recorded_keys.get("sliding_window") or DEFAULT_SLIDING_WINDOW
    return {"model_type": GPT_OSS_MODEL_TYPE, **common, "hidden_size": shape.hidden_size,
            "intermediate_size": shape.moe_ffn_hidden_size, "num_hidden_layers": shape.num_layers,
            "num_attention_heads": shape.num_attention_heads, "num_key_value_heads": shape.num_query_groups,
            "head_dim": shape.kv_channels, "hidden_act": "silu",
            "max_position_embeddings": shape.max_position_embeddings, "rms_norm_eps": shape.norm_epsilon,
            **(hf_yarn_rope_config(shape) if shape.position_embedding_type == "yarn" else hf_rope_config(shape)),
            "attention_bias": shape.add_bias_linear,
            "attention_dropout": shape.attention_dropout, "num_local_experts": shape.num_experts,
            "num_experts_per_tok": shape.moe_router_topk, "swiglu_alpha": QUICK_GELU_ALPHA,
            "swiglu_limit": float(shape.activation_func_clamp_value), "sliding_window": sliding_window,
            "layer_types": [SLIDING if windowed else FULL for windowed in pattern],
            **{key: recorded_keys.get(key, default) for key, default in _TRAINING_ONLY_DEFAULTS.items()}}


def _positive_int(config, key, path):
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConversionError(f"{path}: config.json's {key} ({value!r}) must be a positive integer")
    return value


def _window_flags(config, num_layers, path):
    """--window-size and --window-attn-skip-freq of config.json's layer_types and sliding_window."""
    layer_types = config.get("layer_types") or [SLIDING if windowed else FULL for windowed in _alternating(num_layers)]
    if len(layer_types) != num_layers or any(kind not in (SLIDING, FULL) for kind in layer_types):
        raise ConversionError(f"{path}: layer_types {layer_types}: expected one '{SLIDING}' or '{FULL}' per layer "
                              f"({num_layers}, num_hidden_layers)")
    pattern = [kind == SLIDING for kind in layer_types]
    if not any(pattern):
        return {"window_size": None, "window_attn_skip_freq": None}
    window = _positive_int(config, "sliding_window", path)
    freq = None if all(pattern) else 2 if pattern == _alternating(num_layers) else [int(flag) for flag in pattern]
    return {"window_size": (window - 1, 0), "window_attn_skip_freq": freq}


def _rope_values(config, path):
    """--position-embedding-type, --rotary-base and the RoPE / YaRN flags of config.json (transformers'
    GptOssConfig defaults where it gives none)."""
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or parameters or DEFAULT_ROPE_PARAMETERS
    theta = scaling.get("rope_theta", parameters.get("rope_theta", config.get("rope_theta", DEFAULT_ROPE_THETA)))
    if scaling.get("rope_type", scaling.get("type", "default")) != "yarn":
        return {"position_embedding_type": "rope", **rope_flags_of_config(config, path), "rotary_base": theta}
    factor = parameters.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        raise ConversionError(f"{path}: partial_rotary_factor {factor}: gpt-oss rotates whole heads")
    return {**yarn_flags_of_scaling(scaling, config, path), "rotary_base": theta}


def gpt_oss_shape_values(config: dict, path: str) -> dict:
    """The ModelShape fields (but the vocabulary and the extras' ones) of a gpt-oss config.json; ConversionError
    naming the key our model cannot compute as HF does."""
    alpha = config.get("swiglu_alpha", QUICK_GELU_ALPHA)
    if alpha != QUICK_GELU_ALPHA:
        raise ConversionError(f"{path}: swiglu_alpha {alpha}: --quick-geglu's gate is x * sigmoid("
                              f"{QUICK_GELU_ALPHA} x)")
    limit = config.get("swiglu_limit", 7.0)
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
        raise ConversionError(f"{path}: swiglu_limit {limit!r} must be a positive number "
                              "(--activation-func-clamp-value)")
    num_layers = _positive_int(config, "num_hidden_layers", path)
    experts, width = _positive_int(config, "num_local_experts", path), _positive_int(config, "intermediate_size", path)
    topk = _positive_int(config, "num_experts_per_tok", path)
    if topk > experts:
        raise ConversionError(f"{path}: num_experts_per_tok {topk} exceeds num_local_experts {experts}")
    hidden, heads = _positive_int(config, "hidden_size", path), _positive_int(config, "num_attention_heads", path)
    return dict(
        num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        kv_channels=config.get("head_dim") or hidden // heads, ffn_hidden_size=width,
        max_position_embeddings=_positive_int(config, "max_position_embeddings", path),
        **_rope_values(config, path), normalization="RMSNorm", norm_epsilon=config.get("rms_norm_eps", 1e-5),
        add_bias_linear=bool(config.get("attention_bias", True)),
        moe_router_bias=bool(config.get("attention_bias", True)),
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        attention_dropout=config.get("attention_dropout", 0.0), quick_geglu=True,
        activation_func_clamp_value=float(limit), glu_linear_offset=1.0, softmax_type="learnable",
        **_window_flags(config, num_layers, path), num_experts=experts, moe_ffn_hidden_size=width,
        moe_router_topk=topk, moe_layer_freq=1, moe_router_pre_softmax=False)


def _names(ours: str, theirs: str):
    """(our name, HF name) of a layer's tensors other than its experts and norms, q / k / v."""
    return {"sinks": (ours + "self_attention.softmax_offset", theirs + "self_attn.sinks"),
            "o_proj": (ours + "self_attention.linear_proj.", theirs + "self_attn.o_proj."),
            "router": (ours + "mlp.router.weight", theirs + "mlp.router.weight")}


def gpt_oss_layer_from_hf(take, shape, ours: str, theirs: str, where: str) -> Dict[str, torch.Tensor]:
    """Our tensors of one layer's sinks, attention output projection, router and experts; `take(name, shape)`
    hands out (and checks) HF's tensors."""
    hidden, width, experts = shape.hidden_size, shape.moe_ffn_hidden_size, shape.num_experts
    names, model = _names(ours, theirs), {}
    model[names["sinks"][0]] = take(names["sinks"][1], (shape.num_attention_heads,))
    our_proj, hf_proj = names["o_proj"]
    model[our_proj + "weight"] = take(hf_proj + "weight", (hidden, shape.num_attention_heads * shape.kv_channels))
    if shape.add_bias_linear:
        model[our_proj + "bias"] = take(hf_proj + "bias", (hidden,))
    model[names["router"][0]] = take(names["router"][1], (experts, hidden))

    def zero(name, rows):
        tensor = take(name, rows)
        if torch.count_nonzero(tensor):
            why = "config.json's attention_bias false reads as --disable-bias-linear, whose " + (
                "router has no bias (--moe-router-bias needs linear biases, as upstream's router bias)"
                if name.endswith("router.bias") else "experts have no biases")
            raise ConversionError(f"{where}: '{name}' is not zero, but {why}; the model cannot be imported exactly")

    if shape.moe_router_bias:
        model[ours + "mlp.router.bias"] = take(theirs + "mlp.router.bias", (experts,))
    else:
        zero(theirs + "mlp.router.bias", (experts,))
    packed = theirs + "mlp.experts."
    gate_up = take(packed + "gate_up_proj", (experts, hidden, 2 * width))
    down = take(packed + "down_proj", (experts, width, hidden))
    biases = {"linear_fc1": (packed + "gate_up_proj_bias", (experts, 2 * width)),
              "linear_fc2": (packed + "down_proj_bias", (experts, hidden))}
    if shape.add_bias_linear:
        biases = {linear: take(name, rows) for linear, (name, rows) in biases.items()}
    else:
        for name, rows in biases.values():
            zero(name, rows)
    for expert in range(experts):
        prefix = f"{ours}mlp.experts.local_experts.{expert}."
        model[prefix + "linear_fc1.weight"], model[prefix + "linear_fc2.weight"] = gate_up[expert].t(), down[expert].t()
        if shape.add_bias_linear:
            for linear, packed_bias in biases.items():
                model[f"{prefix}{linear}.bias"] = packed_bias[expert]
    return model


def gpt_oss_layer_to_hf(take, shape, ours: str, theirs: str) -> Dict[str, torch.Tensor]:
    """HF's tensors of one layer's sinks, attention output projection, router and experts; `take(name, shape)`
    hands out (and checks) ours."""
    hidden, width, experts = shape.hidden_size, shape.moe_ffn_hidden_size, shape.num_experts
    names, hf = _names(ours, theirs), {}
    hf[names["sinks"][1]] = take(names["sinks"][0], (shape.num_attention_heads,))
    our_proj, hf_proj = names["o_proj"]
    hf[hf_proj + "weight"] = take(our_proj + "weight", (hidden, shape.num_attention_heads * shape.kv_channels))
    if shape.add_bias_linear:
        hf[hf_proj + "bias"] = take(our_proj + "bias", (hidden,))
    hf[names["router"][1]] = take(names["router"][0], (experts, hidden))
    hf[theirs + "mlp.router.bias"] = (take(ours + "mlp.router.bias", (experts,)) if shape.moe_router_bias
                                      else torch.zeros(experts))
    prefixes = [f"{ours}mlp.experts.local_experts.{expert}." for expert in range(experts)]
    packed = theirs + "mlp.experts."
    hf[packed + "gate_up_proj"] = torch.stack([take(prefix + "linear_fc1.weight", (2 * width, hidden)).t()
                                               for prefix in prefixes])
    hf[packed + "down_proj"] = torch.stack([take(prefix + "linear_fc2.weight", (hidden, width)).t()
                                            for prefix in prefixes])
    for linear, name, rows in (("linear_fc1", "gate_up_proj_bias", 2 * width),
                               ("linear_fc2", "down_proj_bias", hidden)):
        hf[packed + name] = (torch.stack([take(f"{prefix}{linear}.bias", (rows,)) for prefix in prefixes])
                             if shape.add_bias_linear else torch.zeros(experts, rows))
    return hf

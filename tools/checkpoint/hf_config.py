"""config.json both ways: the Hugging Face config of a ModelShape, the ModelShape of a config, and the dtype the
weights are written in. Also the directory's file names and the metadata of megatron_extras.safetensors."""

import dataclasses
import json
from typing import Dict, Optional, Tuple

import torch

from hf_deepseek import DEEPSEEK_V3, deepseek_config, deepseek_flags_of_config, is_deepseek_v3_config
from hf_errors import ConversionError
from hf_families import (
    DENSE_COUNTERPART,
    GPT2,
    GPT2_ACTIVATIONS,
    LLAMA_RELATIVES,
    MISTRAL,
    MIXTRAL,
    MOE_ARCHITECTURES,
    QK_NORM_ARCHITECTURES,
    QWEN2,
    QWEN2_MOE,
    QWEN3,
    QWEN3_MOE,
)
from hf_gpt_oss import GPT_OSS, GPT_OSS_MODEL_TYPE, gpt_oss_config, gpt_oss_shape_values
from hf_hybrid import HYBRID_ARCHITECTURES, hybrid_architecture_of_config, hybrid_config, hybrid_flags_of_config
from hf_moe import hf_moe_config, moe_flags_of_config
from hf_nemotron_nas import NEMOTRON_NAS, is_nemotron_nas_config, nemotron_nas_config, nemotron_nas_flags_of_config
from hf_rope import hf_rope_config, hf_yarn_rope_config, rope_flags_of_config
from hf_shape import ModelShape

MODEL_FILE, MODEL_INDEX_FILE, CONFIG_FILE = "model.safetensors", "model.safetensors.index.json", "config.json"
EXTRAS_FILE = "megatron_extras.safetensors"
# config.json's dtype names (transformers writes `dtype`, older versions `torch_dtype`) -> the tensors' dtype.
HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# transformers' names of x * sigmoid(x), the activation of our SwiGLU (--swiglu).
SILU_NAMES = ("silu", "swish")
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# GPT-2's config.json keys our flags do not say: the activation's name (gelu_new and gelu_pytorch_tanh are both
# --openai-gelu, computed a little differently), n_inner null for 4 x n_embd, and the attention's upcast.
GPT2_RECORDED_CONFIG_KEYS = ("activation_function", "n_inner", "reorder_and_upcast_attn")
# transformers' config class defaults that differ from the ones the import falls back on: a config.json without
# the key means the class default (Mistral's 4096-token window, Mixtral's epsilon and RoPE base, DeepSeek-V3's
# router groups and scaling, ...), not the Llama value that would give a model computing something else.
CONFIG_CLASS_DEFAULTS = {
    MISTRAL: {"sliding_window": 4096, "num_key_value_heads": 8},
    MIXTRAL: {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_key_value_heads": 8},
    QWEN2: {"num_key_value_heads": 32, "sliding_window": 4096, "max_window_layers": 28},
    QWEN3: {"num_key_value_heads": 32, "head_dim": 128, "sliding_window": 4096, "max_window_layers": 28},
    QWEN2_MOE: {"num_key_value_heads": 16, "sliding_window": 4096, "max_window_layers": 28},
    QWEN3_MOE: {"num_key_value_heads": 4, "sliding_window": 4096},
    DEEPSEEK_V3: {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
                  "n_shared_experts": 1},
}


def training_dtype(args) -> Optional[str]:
    """The HF dtype name of the weights a run trained (--bf16, --fp16, else fp32); None for arguments that say
    nothing of it (those an import records)."""
    if getattr(args, "bf16", False):
        return "bfloat16"
    if getattr(args, "fp16", False):
        return "float16"
    return "float32" if hasattr(args, "bf16") or hasattr(args, "fp16") else None


def dtype_of_tensors(tensors: Dict[str, torch.Tensor]) -> str:
    """The HF dtype name most of `tensors` have (float32 when none is a float HF knows)."""
    counts = {}
    for tensor in tensors.values():
        for name, dtype in HF_DTYPES.items():
            if tensor.dtype == dtype:
                counts[name] = counts.get(name, 0) + 1
    return max(counts, key=counts.get) if counts else "float32"


def hf_config(shape: ModelShape, architecture: str, dtype: str = "float32", token_ids: Optional[dict] = None,
              recorded_keys: Optional[dict] = None) -> dict:
    """config.json of the Hugging Face model, its weights in `dtype`; the token ids are those of `token_ids` (a
    model imported from HF keeps its tokenizer's), else none (ours are not GPT-2's or Llama's); `recorded_keys`:
    the keys an import kept that our flags do not say (hf_mapping.RECORDED_CONFIG_KEYS)."""
    token_ids = {key: (token_ids or {}).get(key) for key in TOKEN_ID_KEYS}
    common = {"architectures": [architecture], "vocab_size": shape.vocab_size,
              "initializer_range": shape.init_method_std, "tie_word_embeddings":
              not shape.untie_embeddings_and_output_weights, "use_cache": True, **token_ids,
              "dtype": dtype, "torch_dtype": dtype}
    if architecture == GPT2:
        recorded_keys = recorded_keys or {}
        flags = {"squared_relu": shape.squared_relu, "openai_gelu": shape.openai_gelu}
        names = [name for name, set_flags in GPT2_ACTIVATIONS.items()
                 if {flag: set_flags.get(flag, False) for flag in flags} == flags]
        activation = recorded_keys.get("activation_function")
        activation = activation if activation in names else names[0]
        inner = shape.ffn_hidden_size
        if "n_inner" in recorded_keys and recorded_keys["n_inner"] is None and inner == 4 * shape.hidden_size:
            inner = None
        return {"model_type": "gpt2", **common, "n_positions": shape.max_position_embeddings,
                "n_embd": shape.hidden_size, "n_layer": shape.num_layers, "n_head": shape.num_attention_heads,
                "n_inner": inner, "activation_function": activation,
                "layer_norm_epsilon": shape.norm_epsilon, "resid_pdrop": shape.hidden_dropout,
                "embd_pdrop": shape.hidden_dropout, "attn_pdrop": shape.attention_dropout,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": bool(recorded_keys.get("reorder_and_upcast_attn", False))}
    if architecture == GPT_OSS:
        return gpt_oss_config(shape, common, recorded_keys)
    if architecture == DEEPSEEK_V3:
        return deepseek_config(shape, common, recorded_keys)
    if architecture in HYBRID_ARCHITECTURES:
        return hybrid_config(shape, architecture, common, recorded_keys)
    if architecture == NEMOTRON_NAS:
        return nemotron_nas_config(shape, common)
    llama = {"model_type": LLAMA_RELATIVES[architecture], **common, "hidden_size": shape.hidden_size,
            "intermediate_size": shape.ffn_hidden_size, "num_hidden_layers": shape.num_layers,
            "num_attention_heads": shape.num_attention_heads, "num_key_value_heads": shape.num_query_groups,
            "head_dim": shape.kv_channels, "hidden_act": "silu",
            "max_position_embeddings": shape.max_position_embeddings, "rms_norm_eps": shape.norm_epsilon,
            "rope_theta": float(shape.rotary_base),
            **(hf_yarn_rope_config(shape) if shape.position_embedding_type == "yarn" else hf_rope_config(shape)),
            "attention_bias": shape.qkv_bias, "mlp_bias": shape.add_bias_linear,
            "attention_dropout": shape.attention_dropout}
    attention = DENSE_COUNTERPART.get(architecture, architecture)
    if attention == QWEN3:  # no mlp_bias (always none)
        del llama["mlp_bias"]
    if attention == QWEN2:  # biases on q, k and v only, written without either key (Qwen2-MoE: qkv_bias)
        del llama["attention_bias"], llama["mlp_bias"]
    if attention == MISTRAL:  # no biases at all
        del llama["attention_bias"], llama["mlp_bias"]
        llama["sliding_window"] = None
    if attention in (QWEN2, QWEN3):  # full attention in every layer
        llama.update(use_sliding_window=False, sliding_window=None)
        if architecture in (QWEN2, QWEN3, QWEN2_MOE):
            llama["layer_types"] = ["full_attention"] * shape.num_layers
    if architecture in MOE_ARCHITECTURES:
        llama.update(hf_moe_config(shape, architecture, recorded_keys))
    return llama


def extras_metadata(shape: ModelShape, iteration: int) -> Dict[str, str]:
    return {"format": "megatron_hf_extras", "iteration": str(iteration),
            "megatron_model": json.dumps(dataclasses.asdict(shape))}


def _require(config, key, path):
    if key not in config:
        raise ConversionError(f"{path}: config.json has no '{key}'")
    return config[key]


def _architecture_of_config(config, path):
    """The architecture of a config.json: GPT2 or one of LLAMA_RELATIVES."""
    names = config.get("architectures") or []
    if GPT2 in names or config.get("model_type") == "gpt2":
        return GPT2
    if GPT_OSS in names or config.get("model_type") == GPT_OSS_MODEL_TYPE:
        return GPT_OSS
    if is_deepseek_v3_config(config):
        return DEEPSEEK_V3
    hybrid = hybrid_architecture_of_config(config)
    if hybrid is not None:
        return hybrid
    if is_nemotron_nas_config(config):
        return NEMOTRON_NAS
    for architecture, model_type in LLAMA_RELATIVES.items():
        if architecture in names or config.get("model_type") == model_type:
            return architecture
    known = (GPT2, *LLAMA_RELATIVES, GPT_OSS, DEEPSEEK_V3, *HYBRID_ARCHITECTURES, NEMOTRON_NAS)
    raise ConversionError(f"{path}: config.json describes {names or config.get('model_type')!r}; only "
                          f"{', '.join(known)} convert to our GPT model")


def _sliding_layers(config, architecture):
    """The layers transformers' Qwen config classes give a sliding window (indices): those `layer_types` marks,
    else with use_sliding_window those from max_window_layers on (Qwen2, Qwen3), the even ones below it
    (Qwen2-MoE), or all (Qwen3-MoE)."""
    num_layers = config.get("num_hidden_layers") or 0
    layer_types = config.get("layer_types")
    if layer_types:
        return [index for index, kind in enumerate(layer_types) if kind != "full_attention"]
    if not config.get("use_sliding_window") or config.get("sliding_window") is None:
        return []
    if architecture == QWEN3_MOE:
        return list(range(num_layers))
    max_window_layers = config.get("max_window_layers", num_layers)
    if architecture == QWEN2_MOE:
        return [index for index in range(min(num_layers, max_window_layers)) if index % 2 == 0]
    return list(range(max_window_layers, num_layers))


def _llama_biases(config, architecture, path):
    """(attention_bias, mlp_bias) of a Llama, Mistral or Qwen2 config.json, after refusing sliding-window
    attention, which our attention does not have (a window covering max_position_embeddings is none)."""
    window, positions = config.get("sliding_window"), config.get("max_position_embeddings")
    layer_types = config.get("layer_types") or []
    sliding = _sliding_layers(config, architecture)
    covers_every_position = config.get("use_sliding_window") and isinstance(window, int) and \
        isinstance(positions, int) and window >= positions
    if sliding and not covers_every_position:
        given = f", layer_types {sorted(set(layer_types))}" if layer_types else ""
        raise ConversionError(f"{path}: sliding-window attention in layers {sliding} (config.json "
                              f"use_sliding_window {config.get('use_sliding_window')}, sliding_window {window}, "
                              f"max_window_layers {config.get('max_window_layers')}{given}): our attention is "
                              "causal over the whole sequence")
    if DENSE_COUNTERPART.get(architecture, architecture) == MISTRAL and window is not None and \
            (positions is None or window < positions):
        raise ConversionError(f"{path}: sliding_window {window} below max_position_embeddings {positions}: our "
                              "attention is causal over the whole sequence (Mistral with sliding_window null, or "
                              "a window covering every position, imports)")
    if architecture == QWEN2:
        return True, False  # Qwen2's q, k and v projections have biases, its other linear layers none
    if architecture == QWEN2_MOE:
        return bool(config.get("qkv_bias", True)), False  # older Qwen2-MoE configs lack the key: biases
    if architecture in QK_NORM_ARCHITECTURES:
        return bool(config.get("attention_bias", False)), False  # Qwen3's MLP has no biases
    return bool(config.get("attention_bias", False)), bool(config.get("mlp_bias", False))


def shape_from_hf_config(config: dict, path: str, recorded: Optional[dict], padded_vocab_size: int,
                         apply_layernorm_1p: bool, text: Optional[str] = None) -> Tuple[ModelShape, str]:
    """(shape, architecture) of a Hugging Face directory. config.json decides everything it says; `recorded`
    (the extras' megatron_model, None for a model from elsewhere) adds what it cannot say; `padded_vocab_size`
    and `apply_layernorm_1p` are used where nothing is recorded. `text`: config.json as read (a DeciLM model
    keeps it as its heterogeneous layers' JSON)."""
    architecture = _architecture_of_config(config, path)
    config = {**CONFIG_CLASS_DEFAULTS.get(architecture, {}), **config}
    recorded = recorded or {}
    vocab_size = _require(config, "vocab_size", path)
    values = {"vocab_size": vocab_size, "init_method_std": config.get("initializer_range", 0.02),
              "padded_vocab_size": recorded.get("padded_vocab_size", padded_vocab_size),
              "apply_layernorm_1p": recorded.get("apply_layernorm_1p", apply_layernorm_1p)}
    if architecture == GPT2:
        activation = config.get("activation_function", "gelu_new")
        if activation not in GPT2_ACTIVATIONS:
            raise ConversionError(f"{path}: activation_function '{activation}' has no counterpart in our MLP (exact "
                                  "GeLU is 'gelu', --openai-gelu is 'gelu_pytorch_tanh' or 'gelu_new', "
                                  "--squared-relu is 'relu2')")
        if not config.get("scale_attn_weights", True) or config.get("scale_attn_by_inverse_layer_idx", False):
            raise ConversionError(f"{path}: scale_attn_weights false or scale_attn_by_inverse_layer_idx true: our "
                                  "attention scales by 1 / sqrt(head_dim) only")
        hidden, heads = _require(config, "n_embd", path), _require(config, "n_head", path)
        values.update(
            num_layers=_require(config, "n_layer", path), hidden_size=hidden, num_attention_heads=heads,
            num_query_groups=heads, kv_channels=hidden // heads, ffn_hidden_size=config.get("n_inner") or 4 * hidden,
            max_position_embeddings=_require(config, "n_positions", path), normalization="LayerNorm",
            norm_epsilon=config.get("layer_norm_epsilon", 1e-5), **GPT2_ACTIVATIONS[activation],
            add_bias_linear=recorded.get("add_bias_linear", True), add_qkv_bias=recorded.get("add_qkv_bias", False),
            untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", True),
            hidden_dropout=config.get("resid_pdrop", 0.0), attention_dropout=config.get("attn_pdrop", 0.0))
    elif architecture == DEEPSEEK_V3:
        values.update(deepseek_flags_of_config(config, path, recorded))
    elif architecture in HYBRID_ARCHITECTURES:
        values.update(hybrid_flags_of_config(config, architecture, path, recorded))
    elif architecture == NEMOTRON_NAS:
        values.update(nemotron_nas_flags_of_config(config, path, recorded, text))
    elif architecture == GPT_OSS:
        values.update(gpt_oss_shape_values(config, path), hidden_dropout=recorded.get("hidden_dropout", 0.0),
                      rotary_interleaved=recorded.get("rotary_interleaved", False))
    else:
        if config.get("hidden_act", "silu") not in SILU_NAMES:
            raise ConversionError(f"{path}: hidden_act '{config['hidden_act']}': our gated MLP is SwiGLU (silu)")
        attention_bias, mlp_bias = _llama_biases(config, architecture, path)
        if mlp_bias and not attention_bias:
            raise ConversionError(f"{path}: mlp_bias true with attention_bias false; our linear layers all have "
                                  "biases, none (--disable-bias-linear) or only the QKV one (--add-qkv-bias)")
        hidden, heads = _require(config, "hidden_size", path), _require(config, "num_attention_heads", path)
        values.update(
            num_layers=_require(config, "num_hidden_layers", path), hidden_size=hidden, num_attention_heads=heads,
            num_query_groups=config.get("num_key_value_heads") or heads,
            kv_channels=config.get("head_dim") or hidden // heads,
            ffn_hidden_size=_require(config, "intermediate_size", path),
            max_position_embeddings=_require(config, "max_position_embeddings", path),
            **rope_flags_of_config(config, path),
            rotary_interleaved=recorded.get("rotary_interleaved", False), normalization="RMSNorm",
            qk_layernorm=architecture in QK_NORM_ARCHITECTURES,
            norm_epsilon=config.get("rms_norm_eps", 1e-6), swiglu=True, add_bias_linear=mlp_bias,
            add_qkv_bias=attention_bias and not mlp_bias,
            untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
            hidden_dropout=recorded.get("hidden_dropout", 0.0), attention_dropout=config.get("attention_dropout", 0.0))
        if architecture in MOE_ARCHITECTURES:
            values.update(moe_flags_of_config(config, architecture, values["num_layers"], path))
    if values["padded_vocab_size"] < vocab_size:
        raise ConversionError(f"{path}: vocab_size {vocab_size} in config.json exceeds the recorded padded "
                              f"vocabulary ({values['padded_vocab_size']}); delete {EXTRAS_FILE} to pad anew")
    return ModelShape(**values), architecture


"""Models the Hugging Face conversion does not cover, refused before any tensor is touched.

`--to hf` writes GPT2LMHeadModel, a Llama, Mistral, Qwen2 or Qwen3 model, or with experts a Mixtral, Qwen2-MoE,
Qwen3-MoE or gpt-oss model (see hf_families.py): none has multi-latent attention (DeepSeek-V2/V3's low-rank query
and key/value projections) or multi-token prediction layers (DeepSeek-V3's); their routers take a softmax over all
experts, choose the top k and apply the (renormalised) probabilities to the experts' outputs, dropping no token,
so other scores (sigmoid, DeepSeek-V3's expert bias, group-limited choice), scaled probabilities, expert capacity,
Sinkhorn routing and jitter are refused too. Such checkpoints convert losslessly between our own formats
(`--to torch`, `--to safetensors` and back with `--from`), which keep every tensor under its logical name, the
experts under their global index. Likewise `--from hf` reads only GPT-2, Llama, Mistral, Qwen2, Qwen3, Mixtral,
Qwen2-MoE, Qwen3-MoE and gpt-oss directories (other models with experts, DeepSeek's or OLMoE's say, are refused).

gpt-oss's flags (--quick-geglu, the clamp and offset of its gated MLP, --window-size, --softmax-type) are refused
here for models that cannot be a GptOssForCausalLM (no --quick-geglu with --num-experts); the others are checked
flag by flag when the architecture is chosen (hf_gpt_oss.py). Quantized directories (`quantization_config`, as
gpt-oss's MXFP4 hub checkpoints) are refused by `--from hf`.

DeepseekV3ForCausalLM (hf_deepseek.py) has what the others lack: multi-latent attention, the sigmoid router with
expert bias, group-limited choice and scaled probabilities, and one multi-token prediction layer. For a model with
--multi-latent-attention those flags are checked there; --from hf reads DeepSeek-V3 directories.

Nemotron-H's config.json always has expert keys (`n_routed_experts`, `moe_intermediate_size`); its `moe` blocks
(our hybrid 'E' layers) have DeepSeek-V3's router, whose flags are checked, with the rest of it, in hf_hybrid.py.
"""

from hf_deepseek import EXPORT_FLAGS_CHECKED_HERE, is_deepseek_v3_config
from hf_shape import ModelShape

# (training argument, flag, what Hugging Face would need)
_EXPORT_BLOCKERS = (
    ("multi_latent_attention", "--multi-latent-attention",
     "multi-latent attention (a DeepSeek-V3-style architecture)"),
    ("moe_router_score_function", "--moe-router-score-function",
     "a router without a softmax over the experts (DeepSeek-V3-style), which Mixtral's and Qwen-MoE's routers "
     "take"),
    ("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias",
     "an expert bias in the choice of experts (DeepSeek-V3-style), which HF's Mixtral and Qwen-MoE routers lack"),
    ("moe_router_num_groups", "--moe-router-num-groups", "group-limited routing (DeepSeek-V3-style), which HF's "
                                                         "Mixtral and Qwen-MoE routers lack"),
    ("moe_router_group_topk", "--moe-router-group-topk", "group-limited routing (DeepSeek-V3-style), which HF's "
                                                         "Mixtral and Qwen-MoE routers lack"),
    ("moe_router_topk_scaling_factor", "--moe-router-topk-scaling-factor",
     "scaled routing probabilities, which HF's Mixtral and Qwen-MoE layers do not scale"),
    ("moe_expert_capacity_factor", "--moe-expert-capacity-factor",
     "experts that drop tokens over their capacity, where HF's Mixtral and Qwen-MoE experts take every token"),
    ("moe_router_load_balancing_type", "--moe-router-load-balancing-type",
     "Sinkhorn routing, which HF's Mixtral and Qwen-MoE routers do not compute"),
    ("moe_input_jitter_eps", "--moe-input-jitter-eps",
     "jitter on the router's input alone (HF's Mixtral router_jitter_noise multiplies the experts' input too)"),
    ("moe_apply_probs_on_input", "--moe-apply-probs-on-input",
     "experts applied to the input scaled by its probability, where HF's scale the experts' output"),
    ("moe_router_force_load_balancing", "--moe-router-force-load-balancing",
     "routing by random logits (benchmarking), which no HF router does"),
    ("moe_latent_size", "--moe-latent-size",
     "latent experts (projections to a narrower width around them, Nemotron-3-style), which only "
     "NemotronHForCausalLM's 'moe' blocks compute (a hybrid model's 'E' layers)"),
    ("mtp_num_layers", "--mtp-num-layers", "multi-token prediction layers (DeepSeek-V3-style), which would be "
                                           "lost"),
    ("activation_func_clamp_value", "--activation-func-clamp-value",
     "a clamped gated MLP (gpt-oss-style), which the Llama-family MLP does not compute"),
    ("glu_linear_offset", "--glu-linear-offset",
     "act(gate) * (up + offset) (gpt-oss-style), which the Llama-family MLP does not compute"),
    ("window_size", "--window-size",
     "sliding-window attention (gpt-oss-style), which the exported config.json would not describe"),
    ("softmax_type", "--softmax-type", "attention sinks (gpt-oss-style), which the Llama-family attention does not "
                                       "compute"),
    ("quick_geglu", "--quick-geglu",
     "a gated MLP with quick GeLU, x * sigmoid(1.702 x), on the gate (gpt-oss-style), which no Llama-family MLP "
     "computes (theirs is SwiGLU)"),
    ("no_rope_freq", "--no-rope-freq", "layers without the rotary embedding (Llama 4-style NoPE), which the "
                                       "exported config.json would not describe"),
    ("qk_l2_norm", "--qk-l2-norm", "a weightless L2 norm of the query and key heads (Llama 4-style), which the "
                                   "Llama-family attention does not compute"),
    ("attention_output_gate", "--attention-output-gate",
     "a sigmoid gate on the attention output (Qwen3-Next-style), which the Llama-family attention does not compute"),
)
# Values that are set yet block nothing (a negative capacity factor is dropless; of the load-balancing types only
# Sinkhorn routes differently, the others are losses).
_HARMLESS = {"softmax_type": ("vanilla",), "moe_router_score_function": ("softmax",),
             "moe_router_topk_scaling_factor": (1.0,)}
OWN_FORMATS_HINT = ("convert it with --to torch or --to safetensors instead (every tensor under its logical name, "
                    "converted back with --from torch / --from safetensors)")

# config.json keys that mark a Hugging Face model with experts or latent attention.
_HF_MOE_KEYS = ("num_local_experts", "n_routed_experts", "num_experts", "moe_intermediate_size")
_HF_MLA_KEYS = ("kv_lora_rank", "q_lora_rank")
# The architectures with experts that --from hf reads (hf_families.MOE_ARCHITECTURES), with their model_type.
_HF_MOE_READ = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                "Qwen3MoeForCausalLM": "qwen3_moe", "GptOssForCausalLM": "gpt_oss",
                "DeepseekV3ForCausalLM": "deepseek_v3",
                # every Nemotron-H config.json has the expert keys; its 'moe' blocks are checked by hf_hybrid.py
                "NemotronHForCausalLM": "nemotron_h"}
# The blockers a GptOssForCausalLM computes, left to its own checks for a model that may be one.
_GPT_OSS_FLAGS = ("activation_func_clamp_value", "glu_linear_offset", "window_size", "softmax_type", "quick_geglu")


def hf_export_problems(args):
    """The flags of a checkpoint's training arguments that keep it from being written as a Hugging Face model,
    each with what it would need (empty when none)."""
    problems = []
    experts = bool(getattr(args, "num_experts", None))
    gpt_oss = experts and bool(getattr(args, "quick_geglu", False))
    deepseek = bool(getattr(args, "multi_latent_attention", False))
    # a hybrid model's experts ('E' layers) have Nemotron-H's router, DeepSeek-V3's, checked in hf_hybrid.py
    hybrid_experts = experts and "E" in str(getattr(args, "hybrid_override_pattern", None) or "")
    for name, flag, needs in _EXPORT_BLOCKERS:
        value = getattr(args, name, None)
        if name.startswith("moe_") and not experts:  # a dense model's MoE flags keep their defaults
            continue
        if gpt_oss and name in _GPT_OSS_FLAGS:
            continue
        if deepseek and name in EXPORT_FLAGS_CHECKED_HERE:
            continue
        if hybrid_experts and name in (*ModelShape.DEEPSEEK_ROUTER_FIELDS, "moe_latent_size"):
            continue
        if name == "moe_router_load_balancing_type":
            blocks = "sinkhorn" in ([value] if isinstance(value, str) else list(value or []))
            value = "sinkhorn"
        elif name == "moe_expert_capacity_factor":
            blocks = value is not None and value > 0
        else:
            blocks = bool(value) and value not in _HARMLESS.get(name, ())
        if blocks:
            problems.append(f"{flag}{'' if value is True else f' {value}'}: {needs}")
    return problems


def hf_export_refusal(args):
    """The message refusing `--to hf` for this checkpoint, or None when nothing blocks it."""
    problems = hf_export_problems(args)
    if not problems:
        return None
    return ("Hugging Face export covers GPT-2, Llama, Mistral, Qwen2 and Qwen3 models, with experts Mixtral, "
            "Qwen2-MoE, Qwen3-MoE, gpt-oss and DeepSeek-V3 models, and hybrid Nemotron-H and Mamba2 models only; "
            "this checkpoint was trained with "
            + "; ".join(problems) + f". {OWN_FORMATS_HINT[0].upper()}{OWN_FORMATS_HINT[1:]}")


def hf_import_refusal(config, path):
    """The message refusing `--from hf` for a config.json with experts or latent attention, or quantized weights;
    None when nothing blocks it."""
    quantization = config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
        return (f"{path}: config.json has quantization_config ({method}): the weights are quantized (gpt-oss's hub "
                "checkpoints hold MXFP4 experts), which --from hf does not read; dequantize first with transformers: "
                "AutoModelForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True), "
                "dtype=torch.bfloat16) for MXFP4, then save_pretrained to a new directory and convert that")
    features = []
    names = config.get("architectures") or []
    read = any(name in names or config.get("model_type") == model_type for name, model_type in _HF_MOE_READ.items())
    if any(config.get(key) for key in _HF_MOE_KEYS) and not read:
        features.append("Mixture-of-Experts layers other than Mixtral's, Qwen2-MoE's, Qwen3-MoE's and gpt-oss's (our "
                        "flag: --num-experts)")
    if any(config.get(key) for key in _HF_MLA_KEYS) and not is_deepseek_v3_config(config):
        features.append("multi-latent attention (our flag: --multi-latent-attention)")
    if not features:
        return None
    return (f"{path}: config.json describes a model with " + " and ".join(features) + "; --from hf reads GPT-2, "
            "Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss and DeepSeek-V3 models only")

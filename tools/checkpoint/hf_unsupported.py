"""Models the Hugging Face conversion does not cover, refused before any tensor is touched.

`--to hf` writes GPT2LMHeadModel or a Llama, Mistral, Qwen2 or Qwen3 model (see hf_families.py): none has
multi-latent attention (DeepSeek-V2/V3's low-rank query and key/value projections), Mixture-of-Experts layers (a
router and per-expert MLPs, Mixtral / Qwen-MoE / DeepSeek-V3 style) or multi-token prediction layers
(DeepSeek-V3's), nor gpt-oss's gated MLP (quick GeLU on the gate, clamped, with an offset). Such checkpoints
convert losslessly between our own formats (`--to torch`, `--to safetensors` and back with `--from`), which keep
every tensor under its logical name, the experts under their global index. Likewise `--from hf` reads only
dense GPT-2, Llama, Mistral, Qwen2 and Qwen3 directories.
"""

# (training argument, flag, what Hugging Face would need)
_EXPORT_BLOCKERS = (
    ("multi_latent_attention", "--multi-latent-attention",
     "multi-latent attention (a DeepSeek-V3-style architecture)"),
    ("num_experts", "--num-experts", "Mixture-of-Experts layers (a Mixtral / Qwen-MoE / DeepSeek-V3-style "
                                     "architecture)"),
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
_DEFAULTS = {"softmax_type": "vanilla"}  # values that are set yet block nothing
OWN_FORMATS_HINT = ("convert it with --to torch or --to safetensors instead (every tensor under its logical name, "
                    "converted back with --from torch / --from safetensors)")

# config.json keys that mark a Hugging Face model with experts or latent attention.
_HF_MOE_KEYS = ("num_local_experts", "n_routed_experts", "num_experts", "moe_intermediate_size")
_HF_MLA_KEYS = ("kv_lora_rank", "q_lora_rank")


def hf_export_problems(args):
    """The flags of a checkpoint's training arguments that keep it from being written as a Hugging Face model,
    each with what it would need (empty when none)."""
    problems = []
    for name, flag, needs in _EXPORT_BLOCKERS:
        value = getattr(args, name, None)
        if value and value != _DEFAULTS.get(name):
            problems.append(f"{flag}{'' if value is True else f' {value}'}: {needs}")
    return problems


def hf_export_refusal(args):
    """The message refusing `--to hf` for this checkpoint, or None when nothing blocks it."""
    problems = hf_export_problems(args)
    if not problems:
        return None
    return ("Hugging Face export covers dense GPT-2, Llama, Mistral, Qwen2 and Qwen3 models only; this checkpoint was "
            "trained with "
            + "; ".join(problems) + f". {OWN_FORMATS_HINT[0].upper()}{OWN_FORMATS_HINT[1:]}")


def hf_import_refusal(config, path):
    """The message refusing `--from hf` for a config.json with experts or latent attention, or None."""
    features = []
    if any(config.get(key) for key in _HF_MOE_KEYS):
        features.append("Mixture-of-Experts layers (our flag: --num-experts)")
    if any(config.get(key) for key in _HF_MLA_KEYS):
        features.append("multi-latent attention (our flag: --multi-latent-attention)")
    if not features:
        return None
    return (f"{path}: config.json describes a model with " + " and ".join(features) + "; --from hf reads dense "
            "GPT-2, Llama, Mistral, Qwen2 and Qwen3 models only")

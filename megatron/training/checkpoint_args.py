"""The model a checkpoint holds, against the model of this run: flags that change what the weights mean.

Some flags change how a tensor of an unchanged shape is read: with 4 heads of 8 channels or 8 heads of 4,
`linear_qkv.weight` is (3 * hidden, hidden) either way, but its rows are split into other heads. Others add or drop
tensors that the default `--dist-ckpt-strictness` would quietly skip (an untied output layer, the q/k norms). Of the
mixture-of-experts flags, those of the layout (how many experts, their width, which layers have them, the shared
experts) are compared too: the weights of another layout fail on a tensor's shape or are skipped. Routing choices
(top-k, score function, capacity, auxiliary losses, expert bias) are not: a fine-tune may change them over the same
weights. The widths (--hidden-size, --ffn-hidden-size) are compared as well, so that another width is reported by
its flag rather than by the first tensor whose shape differs; --num-layers is not (a checkpoint's extra layers are
unexpected keys, the strictness flag's to judge). A checkpoint stores the arguments it was trained with; loading
compares those flags with this run's before anything is read, in every format and also under `--finetune` (a
finetune changes the data and the schedule, not the architecture), and refuses another model with an error naming
each flag and both values.
"""

import functools
from typing import Callable, List, NamedTuple, Optional


class ArchitectureFlag(NamedTuple):
    flag: str
    value: Callable  # args -> the value that matters, None where the saved args predate the flag
    is_switch: bool = False  # a store_true flag: shown as set / not set
    compared: Callable = lambda saved_args, args: True  # whether the flag means anything for these models

    def launch_with(self, args) -> str:
        """The command-line words that give `args`' value."""
        value = self.value(args)
        if self.is_switch:
            return self.flag if value else f"no {self.flag}"
        if self.flag == "--num-query-groups" and not getattr(args, "group_query_attention", False):
            return f"no --group-query-attention (one key/value head per attention head, {value})"
        if self.flag == "--num-query-groups":
            return f"--group-query-attention --num-query-groups {value}"
        if self.flag == "--num-experts" and value == 0:
            return "no --num-experts (dense MLPs)"
        if self.flag == "--activation-func-clamp-value" and value == 0:
            return "no --activation-func-clamp-value (no clamping)"
        if self.flag == "--window-size":
            return "no --window-size (full causal attention)" if value == "none" else f'--window-size "{value}"'
        if self.flag == "--window-attn-skip-freq":
            return f'--window-attn-skip-freq "{value}"'
        if self.flag == "--no-rope-freq" and "1" not in value:
            return "no --no-rope-freq (every layer rotates)"
        if self.flag == "--no-rope-freq":
            return f'--no-rope-freq "{value}"'
        if self.flag == "--heterogeneous-layers-config-path":
            return ("uniform layers (no --heterogeneous-layers-config-path)" if value == "none" else
                    f"--heterogeneous-layers-config-path of its layers (query groups/MLP width per layer: {value}; "
                    "--use-checkpoint-args takes them)")
        if self.flag == "--moe-shared-expert-intermediate-size" and value == 0:
            return "no --moe-shared-expert-intermediate-size (no shared experts)"
        if self.flag == "--moe-latent-size" and value == 0:
            return "no --moe-latent-size (experts at the hidden width)"
        return f"{self.flag} {value}"


def _get(name):
    return lambda args: getattr(args, name, None)


def _switch(name):
    return lambda args: bool(getattr(args, name)) if hasattr(args, name) else None


def _hybrid_pattern(args):
    """A hybrid model's layer pattern (resolved by validation, else as given); "none" for a GPT model (and arguments
    older than hybrid models)."""
    return (getattr(args, "hybrid_layer_pattern", None) or getattr(args, "hybrid_override_pattern", None)
            or "none")


def _both_hybrid(saved_args, args):
    return _hybrid_pattern(saved_args) != "none" and _hybrid_pattern(args) != "none"


def _heterogeneous_layers(args):
    """A heterogeneous model's layers, one 'attention/MLP' word each (query groups or linear or none, MLP width
    or linear or none); "none" for uniform layers; None where the saved args predate heterogeneous layers."""
    if not hasattr(args, "heterogeneous_layers_config_encoded_json"):
        return None
    text = args.heterogeneous_layers_config_encoded_json
    if text is None:
        return "none"
    import json

    from megatron.core.transformer.heterogeneous.block_configs import parse_block_configs

    blocks = parse_block_configs(json.loads(text)["block_configs"], hidden_size=args.hidden_size,
                                 num_attention_heads=args.num_attention_heads, source="the heterogeneous layers")

    def word(block, size):
        return "linear" if block.replace_with_linear else "none" if block.no_op else str(size)

    return " ".join(f"{word(b.attention, b.attention.num_query_groups)}/{word(b.mlp, b.mlp.ffn_hidden_size)}"
                    for b in blocks)


def _mamba_heads(args):
    from megatron.core.ssm.mamba_config import mamba_heads

    return mamba_heads(args.hidden_size, args.mamba_head_dim, getattr(args, "mamba_num_heads", None))


def _mamba_dt_limit(args):
    """--mamba-dt-limit as two floats; (0, inf) where unset (no clamp)."""
    limit = getattr(args, "mamba_dt_limit", None)
    return (0.0, float("inf")) if limit is None else tuple(float(bound) for bound in limit)


def _interpolation_factor(args):
    """--rotary-seq-len-interpolation-factor, 1 (positions as they are) where unset."""
    if not hasattr(args, "rotary_seq_len_interpolation_factor"):
        return None
    return float(args.rotary_seq_len_interpolation_factor or 1.0)


def _query_groups(args):
    """Key/value heads: --num-query-groups with --group-query-attention, else one per attention head."""
    heads = getattr(args, "num_attention_heads", None)
    return getattr(args, "num_query_groups", heads) if getattr(args, "group_query_attention", False) else heads


def _kv_channels(args):
    heads, hidden = getattr(args, "num_attention_heads", None), getattr(args, "hidden_size", None)
    return getattr(args, "kv_channels", None) or (hidden // heads if heads and hidden else None)


def _both_use_rope(saved_args, args):
    return all(getattr(a, "position_embedding_type", None) == "rope" for a in (saved_args, args))


def _both_use_yarn(saved_args, args):
    return all(getattr(a, "position_embedding_type", None) == "yarn" for a in (saved_args, args))


def _both_scale_rope(saved_args, args):
    return _both_use_rope(saved_args, args) and all(getattr(a, "use_rope_scaling", False) for a in (saved_args, args))


def _both_use_mla(saved_args, args):
    return all(getattr(a, "multi_latent_attention", False) for a in (saved_args, args))


def _mla_rope_type(args):
    """The rotary embedding of multi-latent attention (yarn unless --rope-type rope)."""
    if not hasattr(args, "rope_type"):
        return None
    return args.rope_type or "yarn"


def _unset_as_zero(name):
    """A size whose unset value (None) means none of the thing: 0 then; None where the saved args predate it."""
    return lambda args: (getattr(args, name) or 0) if hasattr(args, name) else None


def _expert_ffn_hidden_size(args):
    """--moe-ffn-hidden-size, the dense --ffn-hidden-size where unset."""
    if not hasattr(args, "moe_ffn_hidden_size"):
        return None
    return args.moe_ffn_hidden_size or getattr(args, "ffn_hidden_size", None)


def _moe_layer_pattern(args):
    """--moe-layer-freq as one 0/1 per layer (`2` and `[1,0,1,0]` are the same four layers), spelt as the flag
    takes it."""
    from megatron.core.transformer.moe.moe_config import layer_pattern_from_freq

    if not hasattr(args, "moe_layer_freq") or getattr(args, "num_layers", None) is None:
        return None
    pattern = layer_pattern_from_freq(args.moe_layer_freq, args.num_layers)
    return "[" + ",".join("1" if is_moe else "0" for is_moe in pattern) + "]"


def _window_size(args):
    """--window-size as "(left, right)", "none" where unset; None where the saved args predate the flag."""
    if not hasattr(args, "window_size"):
        return None
    from megatron.core.transformer.attention_variants import parse_window_size

    window = parse_window_size(args.window_size)
    return "none" if window is None else "(" + ", ".join(str(side) for side in window) + ")"


def _window_layer_pattern(args):
    """--window-attn-skip-freq as one 0/1 per layer (1: sliding window), spelt as the flag takes it."""
    from megatron.core.transformer.attention_variants import (
        parse_window_attn_skip_freq,
        parse_window_size,
        window_layer_pattern,
    )

    if getattr(args, "num_layers", None) is None or not hasattr(args, "window_size"):
        return None
    pattern = window_layer_pattern(parse_window_size(args.window_size),
                                   parse_window_attn_skip_freq(getattr(args, "window_attn_skip_freq", None)),
                                   args.num_layers)
    return "[" + ",".join("1" if windowed else "0" for windowed in pattern) + "]"


def _no_rope_layer_pattern(args):
    """--no-rope-freq as one 0/1 per layer (1: no rotary embedding), spelt as the flag takes it; None where the saved
    args predate the flag."""
    from megatron.core.transformer.attention_head_transforms import no_rope_layer_pattern, parse_no_rope_freq

    if getattr(args, "num_layers", None) is None or not hasattr(args, "no_rope_freq"):
        return None
    pattern = no_rope_layer_pattern(parse_no_rope_freq(args.no_rope_freq), args.num_layers)
    return "[" + ",".join("1" if skipped else "0" for skipped in pattern) + "]"


def _both_use_rope_over_as_many_layers(saved_args, args):
    return (_both_use_rope(saved_args, args)
            and getattr(saved_args, "num_layers", None) == getattr(args, "num_layers", None))


def _both_use_windows_over_as_many_layers(saved_args, args):
    return (all(getattr(a, "window_size", None) for a in (saved_args, args))
            and getattr(saved_args, "num_layers", None) == getattr(args, "num_layers", None))


def _both_use_moe(saved_args, args):
    return all(getattr(a, "num_experts", None) for a in (saved_args, args))


def _both_use_moe_over_as_many_layers(saved_args, args):
    return _both_use_moe(saved_args, args) and getattr(saved_args, "num_layers", None) == getattr(args, "num_layers")


def _both_have_shared_experts(saved_args, args):
    return _both_use_moe(saved_args, args) and all(
        getattr(a, "moe_shared_expert_intermediate_size", None) for a in (saved_args, args))


def _has_dense_layers(args):
    from megatron.core.transformer.moe.moe_config import layer_pattern_from_freq

    if not getattr(args, "num_experts", None):
        return True
    if getattr(args, "num_layers", None) is None:
        return False
    return not all(layer_pattern_from_freq(getattr(args, "moe_layer_freq", 1), args.num_layers))


def _both_have_dense_layers(saved_args, args):
    """--ffn-hidden-size shapes the dense MLPs only; in a model whose every layer is MoE the expert width is
    --moe-ffn-hidden-size (compared on its own)."""
    return _has_dense_layers(saved_args) and _has_dense_layers(args)


def _either_groups_queries(saved_args, args):
    """Without --group-query-attention on either side the key/value heads are the attention heads, compared
    already."""
    return any(getattr(a, "group_query_attention", False) for a in (saved_args, args))


ARCHITECTURE_FLAGS = (
    ArchitectureFlag("--hidden-size", _get("hidden_size")),
    ArchitectureFlag("--num-attention-heads", _get("num_attention_heads")),
    ArchitectureFlag("--num-query-groups", _query_groups, compared=_either_groups_queries),
    ArchitectureFlag("--kv-channels", _kv_channels),
    ArchitectureFlag("--ffn-hidden-size", _get("ffn_hidden_size"), compared=_both_have_dense_layers),
    ArchitectureFlag("--swiglu", _switch("swiglu"), is_switch=True),
    ArchitectureFlag("--squared-relu", _switch("squared_relu"), is_switch=True),
    ArchitectureFlag("--quick-geglu", _switch("quick_geglu"), is_switch=True),
    ArchitectureFlag("--normalization", _get("normalization")),
    ArchitectureFlag("--apply-layernorm-1p", _switch("apply_layernorm_1p"), is_switch=True),
    ArchitectureFlag("--norm-epsilon", _get("norm_epsilon")),
    ArchitectureFlag("--position-embedding-type", _get("position_embedding_type")),
    ArchitectureFlag("--rotary-percent", _get("rotary_percent"), compared=_both_use_rope),
    ArchitectureFlag("--rotary-base", _get("rotary_base"), compared=_both_use_rope),
    ArchitectureFlag("--rotary-interleaved", _switch("rotary_interleaved"), is_switch=True, compared=_both_use_rope),
    ArchitectureFlag("--use-rope-scaling", _switch("use_rope_scaling"), is_switch=True, compared=_both_use_rope),
    ArchitectureFlag("--rope-scaling-factor", _get("rope_scaling_factor"), compared=_both_scale_rope),
    ArchitectureFlag("--rotary-seq-len-interpolation-factor", _interpolation_factor, compared=_both_use_rope),
    ArchitectureFlag("--add-qkv-bias", _switch("add_qkv_bias"), is_switch=True),
    ArchitectureFlag("--apply-residual-connection-post-layernorm",
                     _switch("apply_residual_connection_post_layernorm"), is_switch=True),
    ArchitectureFlag("--openai-gelu", _switch("openai_gelu"), is_switch=True),
    ArchitectureFlag("--activation-func-clamp-value", _unset_as_zero("activation_func_clamp_value")),
    ArchitectureFlag("--glu-linear-offset", _get("glu_linear_offset")),
    ArchitectureFlag("--untie-embeddings-and-output-weights", _switch("untie_embeddings_and_output_weights"),
                     is_switch=True),
    ArchitectureFlag("--qk-layernorm", _switch("qk_layernorm"), is_switch=True),
    ArchitectureFlag("--window-size", _window_size),
    ArchitectureFlag("--window-attn-skip-freq", _window_layer_pattern, compared=_both_use_windows_over_as_many_layers),
    ArchitectureFlag("--softmax-type", _get("softmax_type")),
    ArchitectureFlag("--no-rope-freq", _no_rope_layer_pattern, compared=_both_use_rope_over_as_many_layers),
    ArchitectureFlag("--qk-l2-norm", _switch("qk_l2_norm"), is_switch=True),
    ArchitectureFlag("--attention-output-gate", _switch("attention_output_gate"), is_switch=True),
    ArchitectureFlag("--multi-latent-attention", _switch("multi_latent_attention"), is_switch=True),
    ArchitectureFlag("--qk-head-dim", _get("qk_head_dim"), compared=_both_use_mla),
    ArchitectureFlag("--qk-pos-emb-head-dim", _get("qk_pos_emb_head_dim"), compared=_both_use_mla),
    ArchitectureFlag("--rope-type", _mla_rope_type, compared=_both_use_mla),
    ArchitectureFlag("--rotary-scaling-factor", _get("rotary_scaling_factor"), compared=_both_use_mla),
    ArchitectureFlag("--mscale", _get("mscale"), compared=_both_use_mla),
    ArchitectureFlag("--mscale-all-dim", _get("mscale_all_dim"), compared=_both_use_mla),
    ArchitectureFlag("--num-experts", _unset_as_zero("num_experts")),
    ArchitectureFlag("--moe-ffn-hidden-size", _expert_ffn_hidden_size, compared=_both_use_moe),
    ArchitectureFlag("--moe-layer-freq", _moe_layer_pattern, compared=_both_use_moe_over_as_many_layers),
    ArchitectureFlag("--moe-shared-expert-intermediate-size", _unset_as_zero("moe_shared_expert_intermediate_size"),
                     compared=_both_use_moe),
    ArchitectureFlag("--moe-shared-expert-gate", _switch("moe_shared_expert_gate"), is_switch=True,
                     compared=_both_have_shared_experts),
    ArchitectureFlag("--moe-router-bias", _switch("moe_router_bias"), is_switch=True, compared=_both_use_moe),
    ArchitectureFlag("--moe-latent-size", _unset_as_zero("moe_latent_size"), compared=_both_use_moe),
    # A hybrid model's layers and Mamba mixers.
    ArchitectureFlag("--hybrid-override-pattern", _hybrid_pattern),
    ArchitectureFlag("--mamba-state-dim", _get("mamba_state_dim"), compared=_both_hybrid),
    ArchitectureFlag("--mamba-head-dim", _get("mamba_head_dim"), compared=_both_hybrid),
    ArchitectureFlag("--mamba-num-groups", _get("mamba_num_groups"), compared=_both_hybrid),
    ArchitectureFlag("--mamba-num-heads", _mamba_heads, compared=_both_hybrid),
    ArchitectureFlag("--mamba-dt-limit", _mamba_dt_limit, compared=_both_hybrid),
    # A heterogeneous model's layers.
    ArchitectureFlag("--heterogeneous-layers-config-path", _heterogeneous_layers),
    # YaRN of standard attention (--position-embedding-type yarn).
    ArchitectureFlag("--rotary-percent", _get("rotary_percent"), compared=_both_use_yarn),
    ArchitectureFlag("--rotary-base", _get("rotary_base"), compared=_both_use_yarn),
    ArchitectureFlag("--rotary-interleaved", _switch("rotary_interleaved"), is_switch=True, compared=_both_use_yarn),
    ArchitectureFlag("--yarn-rotary-scaling-factor", _get("yarn_rotary_scaling_factor"), compared=_both_use_yarn),
    ArchitectureFlag("--yarn-original-max-position-embeddings", _get("yarn_original_max_position_embeddings"),
                     compared=_both_use_yarn),
    ArchitectureFlag("--yarn-beta-fast", _get("yarn_beta_fast"), compared=_both_use_yarn),
    ArchitectureFlag("--yarn-beta-slow", _get("yarn_beta_slow"), compared=_both_use_yarn),
    ArchitectureFlag("--yarn-mscale", _get("yarn_mscale"), compared=_both_use_yarn),
    ArchitectureFlag("--yarn-mscale-all-dim", _get("yarn_mscale_all_dim"), compared=_both_use_yarn),
    ArchitectureFlag("--yarn-correction-range-round-to-int", _switch("yarn_correction_range_round_to_int"),
                     is_switch=True, compared=_both_use_yarn),
)
VOCAB_FLAG = "vocabulary size (the tokenizer's, before padding; --vocab-size + 1 with NullTokenizer)"


@functools.lru_cache(maxsize=8)
def _tokenizer_vocab_size(tokenizer_type, vocab_size, vocab_file, merge_file, tokenizer_model):
    from megatron.training.tokenizer import build_tokenizer

    return build_tokenizer(tokenizer_type, vocab_size=vocab_size, vocab_file=vocab_file, merge_file=merge_file,
                           tokenizer_model=tokenizer_model).vocab_size


def true_vocab_size(args) -> Optional[int]:
    """This run's vocabulary size before padding (the tokenizer's), or None when no tokenizer is configured."""
    if getattr(args, "tokenizer_type", None) is None:
        return None
    if args.tokenizer_type == "TikTokenizer":  # --vocab-size (or upstream's default), whatever the file holds
        from megatron.training.tokenizer.tiktoken_tokenizer import DEFAULT_VOCAB_SIZE

        return getattr(args, "vocab_size", None) or DEFAULT_VOCAB_SIZE
    return _tokenizer_vocab_size(args.tokenizer_type, getattr(args, "vocab_size", None),
                                 getattr(args, "vocab_file", None), getattr(args, "merge_file", None),
                                 getattr(args, "tokenizer_model", None))


def saved_true_vocab_size(recorded: Optional[int], saved_args) -> Optional[int]:
    """The checkpoint's vocabulary size before padding: as recorded at save, else what its args say (a
    NullTokenizer's --vocab-size + 1: its text ids and the end-of-document id); None when neither tells."""
    if recorded is not None:
        return int(recorded)
    if getattr(saved_args, "tokenizer_type", None) == "NullTokenizer" and getattr(saved_args, "vocab_size", None):
        return saved_args.vocab_size + 1  # the text ids and the end-of-document id after them
    return None


def _rows_stand_for_the_vocabulary(saved_args, saved_vocab_size, args) -> bool:
    """Whether the checkpoint, imported without a tokenizer (no --tokenizer-type recorded), records its embedding
    rows as its vocabulary and this run pads its own tokenizer to exactly those rows: the rows beyond this
    tokenizer's tokens are then padding, and the weights mean what they meant."""
    rows = getattr(saved_args, "padded_vocab_size", None)
    return (rows is not None and getattr(saved_args, "tokenizer_type", None) is None
            and saved_vocab_size == rows and getattr(args, "padded_vocab_size", None) == rows)


def _vocab_differs(saved_args, args, saved_vocab_size, vocab_size) -> bool:
    return (saved_vocab_size is not None and vocab_size is not None and saved_vocab_size != vocab_size
            and not _rows_stand_for_the_vocabulary(saved_args, saved_vocab_size, args))


def _vocab_wanted(saved_args, args, saved_vocab_size, vocab_size) -> str:
    """The launch flags that give the checkpoint's vocabulary."""
    from megatron.training.tokenizer import exact_padding_divisor

    if getattr(saved_args, "tokenizer_type", None) == "NullTokenizer":
        return (f"--tokenizer-type NullTokenizer --vocab-size {saved_vocab_size - 1} ({saved_vocab_size} tokens with "
                "the end-of-document id)")
    rows = getattr(saved_args, "padded_vocab_size", None)
    if rows is None or getattr(saved_args, "tokenizer_type", None) is not None or saved_vocab_size != rows:
        return f"tokenizer ({saved_vocab_size} tokens)"
    # Imported without a tokenizer: the rows stand for the vocabulary, and a smaller tokenizer fits when padded
    # to exactly them.
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    padded = getattr(args, "padded_vocab_size", None)
    origin = padding_origin(padded, vocab_size, getattr(args, "make_vocab_size_divisible_by", None), tp)
    this_run = f"; this run pads its {vocab_size} tokens to {padded} rows ({origin})" if padded is not None else ""
    divisor = exact_padding_divisor(vocab_size, rows, tp)
    fit = (f"--make-vocab-size-divisible-by {divisor}, which pads them to exactly {rows} at TP {tp}" if divisor
           else f"no --make-vocab-size-divisible-by pads {vocab_size} tokens to exactly {rows} rows at TP {tp}")
    return (f"tokenizer ({rows} tokens, the embedding's rows, as the checkpoint was imported without a tokenizer; "
            f"a tokenizer of fewer tokens loads it when padded to exactly those rows: for this run's {vocab_size} "
            f"tokens {fit}{this_run})")


def _differing_flags(saved_args, args):
    for flag in ARCHITECTURE_FLAGS:
        if flag.compared(saved_args, args):
            saved, current = flag.value(saved_args), flag.value(args)
            if saved is not None and current is not None and saved != current:
                yield flag, saved, current


def _phrase(flag, value):
    return ("set" if value else "not set") if flag.is_switch else str(value)


def architecture_differences(saved_args, args, saved_vocab_size=None, vocab_size=None) -> List[str]:
    """One phrase per flag whose value differs ('--num-attention-heads: 4 in the checkpoint, 8 in this run')."""
    differences = [f"{flag.flag}: {_phrase(flag, saved)} in the checkpoint, {_phrase(flag, current)} in this run"
                   for flag, saved, current in _differing_flags(saved_args, args)]
    if _vocab_differs(saved_args, args, saved_vocab_size, vocab_size):
        differences.append(f"{VOCAB_FLAG}: {saved_vocab_size} in the checkpoint, {vocab_size} in this run")
    return differences


# Flags that set how many layers (and so which layer tensors) a model has; a checkpoint of another count loads only
# partly (--dist-ckpt-strictness), so they are named when its tensors do not match rather than refused up front.
LAYER_COUNT_FLAGS = (("--num-layers", "num_layers"), ("--mtp-num-layers", "mtp_num_layers"))


def layer_count_hint(saved_args, args):
    """'saved with --num-layers 2, this run has --num-layers 3: launch with the checkpoint's (--use-checkpoint-args
    takes them)', or None when the layer counts agree (or the checkpoint records no arguments)."""
    if saved_args is None:
        return None
    differing = [(flag, getattr(saved_args, name, None) or 0, getattr(args, name, None) or 0)
                 for flag, name in LAYER_COUNT_FLAGS
                 if (getattr(saved_args, name, None) or 0) != (getattr(args, name, None) or 0)]
    if not differing:
        return None
    saved = ", ".join(f"{flag} {value}" for flag, value, _ in differing)
    current = ", ".join(f"{flag} {value}" for flag, _, value in differing)
    return (f"The checkpoint was saved with {saved}, this run has {current}: launch with the checkpoint's "
            f"({saved}; --use-checkpoint-args takes them)")


def check_same_architecture(checkpoint: str, saved_args, args, saved_vocab_size=None, vocab_size=None):
    """Raise a CheckpointError naming every flag that makes this run's model another model than the
    checkpoint's. Nothing is checked when the checkpoint records no arguments (e.g. converted from weights)."""
    if saved_args is None:
        return
    differences = architecture_differences(saved_args, args, saved_vocab_size, vocab_size)
    if not differences:
        return
    from megatron.core.dist_checkpointing.serialization import CheckpointError

    wanted = [flag.launch_with(saved_args) for flag, _, _ in _differing_flags(saved_args, args)]
    if _vocab_differs(saved_args, args, saved_vocab_size, vocab_size):
        wanted.append(_vocab_wanted(saved_args, args, saved_vocab_size, vocab_size))
    raise CheckpointError(
        f"checkpoint {checkpoint} holds another model than this run builds: " + "; ".join(differences) + ". "
        "These change what the saved weights mean (most without changing their shapes) or which weights there "
        "are, so loading would fail or silently give a different model. To load it, launch with the checkpoint's "
        + ", ".join(wanted) + " (also with --finetune, which keeps the architecture); a model of another "
        "architecture cannot start from it.")


# ---------------------------------------------------------------------------------------------------------
# --use-checkpoint-args: the checkpoint's model over the command line's
# ---------------------------------------------------------------------------------------------------------

# What shapes the model (and its tokenizer), and the dropout: taken from the checkpoint whatever the command line
# says.
MODEL_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads", "num_query_groups",
    "group_query_attention", "kv_channels", "max_position_embeddings", "position_embedding_type", "rotary_base",
    "rotary_percent", "add_bias_linear", "swiglu", "squared_relu", "untie_embeddings_and_output_weights",
    "apply_layernorm_1p", "normalization", "norm_epsilon", "qk_layernorm", "make_vocab_size_divisible_by",
    "tokenizer_type", "vocab_size", "add_qkv_bias", "rotary_interleaved", "apply_residual_connection_post_layernorm",
    "openai_gelu", "use_rope_scaling", "rope_scaling_factor", "rotary_seq_len_interpolation_factor",
    "activation_func_clamp_value", "glu_linear_offset", "quick_geglu",
    # Not shapes, but taken as upstream takes them: a resume trains with the checkpoint's dropout.
    "attention_dropout", "hidden_dropout", "apply_query_key_layer_scaling",
    # Sliding-window attention and attention sinks.
    "window_size", "window_attn_skip_freq", "softmax_type",
    # NoPE layers and the QK L2 norm (Llama 4), the attention output gate (Qwen3-Next).
    "no_rope_freq", "qk_l2_norm", "attention_output_gate",
    # Multi-token prediction (its layers' tensors).
    "mtp_num_layers", "mtp_use_repeated_layer",
    # Multi-latent attention.
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
    "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim", "original_max_position_embeddings",
    # Mixture of experts.
    "num_experts", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_topk", "moe_router_score_function",
    "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_enable_expert_bias", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
    "moe_apply_probs_on_input",
    "moe_router_bias", "moe_latent_size",
    # How the router picks experts (sinkhorn routes otherwise than top-k; top-1 sinkhorn needs no pre-softmax).
    "moe_router_load_balancing_type",
    # YaRN of standard attention.
    "yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
    "yarn_mscale", "yarn_mscale_all_dim", "yarn_correction_range_round_to_int",
    # A hybrid model's layers and Mamba mixers.
    "is_hybrid_model", "hybrid_override_pattern", "hybrid_attention_ratio", "hybrid_mlp_ratio", "mamba_state_dim",
    "mamba_head_dim", "mamba_num_groups", "mamba_num_heads", "mamba_dt_limit",
    # A heterogeneous model's layers (the JSON text itself, so the file need not exist where the checkpoint loads).
    "heterogeneous_layers_config_path", "heterogeneous_layers_config_encoded_json",
)
# Files the tokenizer reads: taken from the checkpoint only where the command line leaves them unset (a
# checkpoint copied to another machine names paths that may not exist there).
TOKENIZER_FILE_ARGS = ("vocab_file", "merge_file", "tokenizer_model", "tiktoken_pattern",
                       "tiktoken_num_special_tokens", "tiktoken_special_tokens")
# The model-parallel layout: taken from the checkpoint with --use-mp-args-from-checkpoint-args.
PARALLEL_ARGS = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
    "pipeline_model_parallel_layout", "expert_model_parallel_size", "expert_tensor_parallel_size",
)


def _flag(name):
    return "--" + name.replace("_", "-")


def apply_checkpoint_args(args, saved, with_parallel_layout=False, with_tokenizer_model=True) -> List[str]:
    """Set `args`' model arguments (and with `with_parallel_layout` the TP/PP/EP layout) to `saved`'s, before
    validation derives anything from them; returns one phrase per value that the command line had otherwise.
    Names the saved arguments lack (an older checkpoint) keep the command line's value. Without
    `with_tokenizer_model` (--no-use-tokenizer-model-from-checkpoint-args) the saved --tokenizer-model is not taken."""
    forced = MODEL_ARGS + (PARALLEL_ARGS if with_parallel_layout else ())
    changed = []
    for name in forced + TOKENIZER_FILE_ARGS:
        if not hasattr(saved, name) or not hasattr(args, name):
            continue
        value, current = getattr(saved, name), getattr(args, name)
        if name in TOKENIZER_FILE_ARGS and current is not None:
            continue
        if name == "tokenizer_model" and not with_tokenizer_model:
            continue
        # The key/value heads matter only with --group-query-attention; without it the saved value is the
        # one validation derived (one per head), which this run derives again from its own heads.
        if name == "num_query_groups" and not getattr(saved, "group_query_attention", False):
            continue
        if value != current and current is not None:
            changed.append(f"{_flag(name)} {value} (command line: {current})")
        setattr(args, name, value)
    # As upstream, the word embedding keeps the checkpoint's rows whatever this run's TP size: padding anew to
    # --make-vocab-size-divisible-by x TP would give another embedding at another TP size (128 rows at TP 1,
    # 256 at TP 2 for 120 tokens padded to multiples of 128), whose padding rows enter the softmax.
    if getattr(saved, "padded_vocab_size", None) is not None:
        args.padded_vocab_size = saved.padded_vocab_size
    return changed


def padding_origin(rows, vocab_size, divisor, tp) -> str:
    """How a run came to `rows` embedding rows, for messages: 'D x TP t' when --make-vocab-size-divisible-by D
    pads `vocab_size` tokens to them at TP t, else the checkpoint's rows that --use-checkpoint-args kept."""
    from megatron.training.tokenizer import pad_vocab_size

    if vocab_size and isinstance(divisor, int) and isinstance(tp, int) and pad_vocab_size(vocab_size, divisor, tp) \
            == rows:
        return f"--make-vocab-size-divisible-by {divisor} x TP {tp}"
    return f"at TP {tp}, the rows of the checkpoint it resumed with --use-checkpoint-args"


# What each --optimizer keeps per parameter: the saved state of one does not fit another.
_OPTIMIZER_STATE = {"adam": "two Adam moments", "sgd": "a momentum buffer", "muon": "Muon's momentum buffers for the "
                    "hidden weight matrices and Adam's moments for the rest"}


def check_resumed_optimizer(saved_args, args, path):
    """Refuse a checkpoint's optimizer state saved under another --optimizer: the per-parameter state differs."""
    saved, current = getattr(saved_args, "optimizer", None), getattr(args, "optimizer", None)
    if saved is None or current is None or saved == current:
        return
    from megatron.core.dist_checkpointing.serialization import CheckpointError

    raise CheckpointError(
        f"{path}: the optimizer state was saved with --optimizer {saved} ({_OPTIMIZER_STATE.get(saved, 'its state')}), "
        f"which does not fit --optimizer {current} ({_OPTIMIZER_STATE.get(current, 'another state')}). Pass "
        "--no-load-optim to load the weights and the iteration and start the optimizer state and the learning-rate "
        f"schedule afresh, or resume with --optimizer {saved}.")

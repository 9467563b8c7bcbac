"""Three per-head changes to standard self-attention (attention.py), with upstream Megatron-LM's flags.

- NoPE layers (`--no-rope-freq`, Llama 4): the layers the pattern marks skip the rotary embedding; their queries
  and keys carry no position. An integer N marks every N-th layer (1-based: N, 2N, ...), i.e. a 1:N ratio of NoPE
  layers; a list has one entry per layer, 1 for "no rope". As upstream, an integer must divide `--num-layers`.
- QK L2 norm (`--qk-l2-norm`, Llama 4): each query and key head is divided by its root mean square over the head
  dim, x * rsqrt(mean(x^2) + eps) with eps = `--norm-epsilon`, computed in fp32 and without a learned weight
  (upstream's `L2Norm`, which its layer spec puts where `--qk-layernorm`'s norms go, on every layer). It is taken
  before the rotary embedding, in that place as upstream; a rotation keeps the mean square, so this equals Llama
  4's order (after the rotation) except under YaRN, whose factor on cos and sin then reaches the logits, as
  upstream.
- Attention output gate (`--attention-output-gate`, Qwen3-Next): the QKV projection also produces a gate g with one
  entry per query channel, and the attention output is multiplied by sigmoid(g) (in fp32) before the output
  projection. Per query group the fused rows are `[q_0 .. q_{m-1} | g_0 .. g_{m-1} | k | v]` of head_dim each
  (upstream's layout: a group's gate heads follow its query heads), so a contiguous slice of rows is still a set
  of whole groups and tensor parallelism splits it as before.

All three act on one token at a time, so sequence and context parallelism leave them exact, and decoding through
the key/value cache stores the keys as the layer uses them (without rotation on a NoPE layer, normalised with the
L2 norm).
"""

import torch

NO_ROPE_FLAG = "--no-rope-freq"


def parse_no_rope_freq(value):
    """`--no-rope-freq`: None, an int N, or a list expression of 0/1 per layer such as "([0]*3+[1]*1)*2"."""
    from megatron.core.transformer.moe.moe_config import parse_moe_layer_freq

    if value is None or isinstance(value, (list, tuple)):
        return value
    try:
        return parse_moe_layer_freq(value)
    except ValueError:
        raise ValueError(f"{NO_ROPE_FLAG} takes an integer N or a list expression of 0s and 1s such as "
                         f"([0]*3+[1]*1)*2 (1: the layer skips the rotary embedding), got {value!r}") from None


def is_no_rope_layer(no_rope_freq, layer_number):
    """Whether the layer of 1-based `layer_number` skips the rotary embedding (upstream's rule)."""
    if not no_rope_freq:
        return False
    if isinstance(no_rope_freq, int):
        return layer_number % no_rope_freq == 0
    return bool(no_rope_freq[layer_number - 1])


def no_rope_layer_pattern(no_rope_freq, num_layers):
    """One bool per layer (0-based index): True where the layer skips the rotary embedding."""
    return [is_no_rope_layer(no_rope_freq, number) for number in range(1, num_layers + 1)]


def validated_head_transforms(config):
    """`config.no_rope_freq` in its stored form (None, an int, or a tuple of 0/1), after checking the three flags
    and what they compose with; raises ValueError naming the flags."""
    freq = parse_no_rope_freq(config.no_rope_freq)
    if isinstance(freq, bool) or (freq is not None and not isinstance(freq, (int, list, tuple))):
        raise ValueError(f"{NO_ROPE_FLAG} takes an integer or a list of 0s and 1s, got {config.no_rope_freq!r}")
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"{NO_ROPE_FLAG} must be >= 1 (every N-th layer skips the rotary embedding), got {freq}")
        if config.num_layers % freq:
            raise ValueError(f"{NO_ROPE_FLAG} {freq} must divide --num-layers {config.num_layers} (as upstream); "
                             "give a list with one 0 or 1 per layer for another pattern")
    elif freq is not None:
        if len(freq) != config.num_layers or any(flag not in (0, 1) for flag in freq):
            raise ValueError(f"{NO_ROPE_FLAG} as a list needs one 0 or 1 per layer ({config.num_layers} for "
                             f"--num-layers; 1 skips the rotary embedding), got {list(freq)}")
        freq = tuple(int(flag) for flag in freq)
    used = [flag for flag, on in ((NO_ROPE_FLAG, freq is not None), ("--qk-l2-norm", config.qk_l2_norm),
                                  ("--attention-output-gate", config.attention_output_gate)) if on]
    if used and config.multi_latent_attention:
        flags = " and ".join(used)
        raise ValueError(f"{flags} {'changes' if len(used) == 1 else 'change'} standard self-attention, which "
                         f"--multi-latent-attention replaces: drop {flags} or --multi-latent-attention")
    if config.qk_l2_norm and config.qk_layernorm:
        raise ValueError("--qk-l2-norm and --qk-layernorm both normalise each query and key head: use one of them")
    return freq


def l2_normalize_heads(heads, eps):
    """`heads` `[..., head_dim]` divided by their root mean square over head_dim (fp32 inside, no weight)."""
    heads_fp32 = heads.float()
    return (heads_fp32 * torch.rsqrt(heads_fp32.pow(2).mean(-1, keepdim=True) + eps)).type_as(heads)


def fused_qkv_rows_per_group(heads_per_group, head_dim, gated):
    """Rows of one query group in the fused QKV weight: (q, g, k, v) with the output gate, else (q, k, v)."""
    query_rows = heads_per_group * head_dim
    return (query_rows, query_rows, head_dim, head_dim) if gated else (query_rows, head_dim, head_dim)


def split_fused_qkv(mixed_qkv, groups, heads_per_group, head_dim, gated):
    """The QKV projection's output `[s, b, groups * rows per group]` -> query `[s, b, heads, head_dim]`, key and
    value `[s, b, groups, head_dim]`, and the gate `[s, b, heads * head_dim]` (None without `gated`), with query
    head and gate head g * heads_per_group + j belonging to group g."""
    seq_len, batch = mixed_qkv.shape[0], mixed_qkv.shape[1]
    rows = fused_qkv_rows_per_group(heads_per_group, head_dim, gated)
    parts = torch.split(mixed_qkv.view(seq_len, batch, groups, sum(rows)), list(rows), dim=-1)
    query, key, value = parts[0], parts[-2], parts[-1]
    query = query.reshape(seq_len, batch, groups * heads_per_group, head_dim)
    gate = parts[1].reshape(seq_len, batch, groups * heads_per_group * head_dim) if gated else None
    return query, key, value, gate


def gate_attention_output(context, gate):
    """`context` `[s, b, heads * head_dim]` times sigmoid(`gate`) of the same shape, in fp32, cast back."""
    return (context.float() * torch.sigmoid(gate.float())).to(context.dtype)

"""Sliding-window attention and attention sinks (gpt-oss): `--window-size`, `--window-attn-skip-freq` and
`--softmax-type`, with upstream Megatron-LM's names and meanings.

Sliding window `(left, right)`: query i sees key j when i - left <= j <= i + right; -1 on a side means no limit
there. GPT attention is causal, so the causal mask stays on top and `right` cannot open the future. Which layers
use the window: every layer without `window_attn_skip_freq`; with an int N, the layers whose 1-based number is not
a multiple of N (one full-attention layer after N - 1 windowed ones); with a 0/1 list, one entry per layer, 1 for
the window and 0 for full attention.

Attention sinks add a term to the softmax's denominator of every query and head, so a query may attend to
nothing: "off-by-one" adds exp(0) = 1, "learnable" adds exp(s_h) with one learned logit s_h per head (upstream's
`softmax_offset`, initialised to zero). p_ij = exp(l_ij) / (exp(s_h) + sum_k exp(l_ik)). With Z = sum_k exp(l_ik)
that is the plain softmax times Z / (Z + exp(s_h)) = sigmoid(lse_i - s_h), lse_i = log Z: attention computed
without the sink, returning the rows' log-sum-exp, is made exact by `sink_rescaled` (how context parallelism does
it, where no rank holds every key).

`SelfAttention` and `MLASelfAttention` both take their window masks, sinks and sink parameter from here.
"""

import math

import torch

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def parse_window_size(value):
    """`--window-size` as upstream's tuple type takes it: "(128, 0)", "128,0" or a pair -> (left, right)."""
    if value is None or isinstance(value, tuple):
        return value
    if isinstance(value, list):
        return tuple(value)
    try:
        return tuple(int(part) for part in str(value).strip().strip("()").split(","))
    except ValueError:
        raise ValueError(f"--window-size takes two integers such as \"(128, 0)\" (left, right), "
                         f"got {value!r}") from None


def parse_window_attn_skip_freq(value):
    """`--window-attn-skip-freq`: an int N, or a list expression of 0/1 per layer such as "([1]*3+[0]*1)*2"."""
    from megatron.core.transformer.moe.moe_config import parse_moe_layer_freq

    if value is None:
        return None
    try:
        return parse_moe_layer_freq(value)
    except ValueError:
        raise ValueError(f"--window-attn-skip-freq takes an integer N or a list expression of 0s and 1s such as "
                         f"([1]*3+[0]*1)*2 (1: sliding window, 0: full attention), got {value!r}") from None


def window_layer_pattern(window_size, window_attn_skip_freq, num_layers):
    """One bool per layer (0-based index): True where the layer attends through the sliding window."""
    return [is_layer_window_attention(window_size, window_attn_skip_freq, number)
            for number in range(1, num_layers + 1)]


def is_layer_window_attention(window_size, window_attn_skip_freq, layer_number):
    """Whether the layer of 1-based `layer_number` uses the sliding window (upstream's rule)."""
    if not window_size:
        return False
    if window_attn_skip_freq is None:
        return True
    if isinstance(window_attn_skip_freq, int):
        return layer_number % window_attn_skip_freq != 0
    return bool(window_attn_skip_freq[layer_number - 1])


def window_blocked(query_positions, key_positions, window_size):
    """Bool `[s_q, s_k]`, True where query (at `query_positions`) may NOT see key (at `key_positions`): after
    the query (causal) or outside the window."""
    offset = query_positions.unsqueeze(1) - key_positions.unsqueeze(0)  # i - j
    blocked = offset < 0
    left, right = window_size
    if left >= 0:
        blocked |= offset > left
    if right >= 0:
        blocked |= offset < -right
    return blocked


def windowed_mask(attention_mask, window_size, seq_len, device):
    """Megatron's mask (None: causal; else bool broadcastable to `[b, heads, s, s]`, True where masked) with the
    window added: a bool `[1, 1, s, s]` or the mask's own shape."""
    positions = torch.arange(seq_len, device=device)
    blocked = window_blocked(positions, positions, window_size).view(1, 1, seq_len, seq_len)
    return blocked if attention_mask is None else attention_mask.to(torch.bool) | blocked


def sink_logits(softmax_type, softmax_offset, heads, device):
    """The per-head logit the sink adds to the denominator: None for vanilla, zeros for off-by-one."""
    if softmax_type == "learnable":
        return softmax_offset
    if softmax_type == "off-by-one":
        return torch.zeros(heads, device=device)
    return None


def build_softmax_offset(config, heads_per_partition):
    """The learnable sinks' parameter `softmax_offset` `[heads per partition]` (zeros, split over tensor-parallel
    ranks by heads like the queries) for `--softmax-type learnable`; None for the other types. The owning module
    zeroes it again in its `reset_parameters()` (meta-device initialisation)."""
    if config.softmax_type != "learnable":
        return None
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
    from megatron.core.transformer.utils import parameter_device

    offset = torch.nn.Parameter(torch.zeros(heads_per_partition, dtype=config.params_dtype,
                                            device=parameter_device(config)))
    set_tensor_model_parallel_attributes(offset, is_parallel=True, dim=0, stride=1)
    return offset


def blocked_or_causal(attention_mask, query_len, key_len, device):
    """Megatron's `attention_mask` (None: causal) as a bool mask, True where masked."""
    if attention_mask is None:
        return torch.ones(query_len, key_len, dtype=torch.bool, device=device).triu(1)
    return attention_mask.to(torch.bool)


def sink_rescaled(out, lse, sinks):
    """Attention output computed without the sink -> with it. `out` `[..., heads, d]`, `lse` `[..., heads]` the
    log-sum-exp of each row's logits over every key (-inf where a row sees none), `sinks` `[heads]` logits:
    out * sigmoid(lse - s_h), in fp32 (or wider), returned in `out`'s dtype. Differentiable in all three."""
    dtype = torch.promote_types(out.dtype, torch.float32)
    factor = torch.sigmoid(lse.to(dtype) - sinks.to(dtype))
    return (out.to(dtype) * factor.unsqueeze(-1)).to(out.dtype)


def attention_with_sinks(query, key, value, blocked, sinks, dropout_p=0.0, scale=None):
    """Attention whose softmax has a sink: `[b, heads, s_q, d]` queries, `[b, groups, s_k, d]` keys and values,
    `blocked` bool broadcastable to `[b, heads, s_q, s_k]` (True where masked), `sinks` `[heads]` logits ->
    `[b, heads, s_q, d]`. The softmax runs in fp32 (or the inputs' wider dtype); a query whose keys are all
    masked attends to the sink only."""
    heads, groups = query.shape[1], key.shape[1]
    if groups != heads:
        key = key.repeat_interleave(heads // groups, dim=1)
        value = value.repeat_interleave(heads // groups, dim=1)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    softmax_dtype = torch.promote_types(query.dtype, torch.float32)  # at least fp32
    scores = torch.matmul(query, key.transpose(-1, -2)).to(softmax_dtype) * scale
    scores = scores.masked_fill(blocked, float("-inf"))
    sink = sinks.to(softmax_dtype).view(1, heads, 1, 1).expand(scores.shape[0], heads, scores.shape[2], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    if dropout_p > 0.0:
        probs = torch.nn.functional.dropout(probs, p=dropout_p)
    return torch.matmul(probs.to(value.dtype), value)


def validated_attention_variants(config):
    """(window_size, window_attn_skip_freq) of `config` in their stored forms (a pair; an int or a tuple of
    0/1), after checking the three flags and what they compose with; raises ValueError naming the flags."""
    window = parse_window_size(config.window_size)
    if window is not None and (len(window) != 2 or any(
            isinstance(side, bool) or not isinstance(side, int) or side < -1 for side in window)):
        raise ValueError(f"--window-size takes two integers (left, right), each >= 0 or -1 for no limit, got "
                         f"{config.window_size!r}")
    freq = parse_window_attn_skip_freq(config.window_attn_skip_freq)
    if freq is not None:
        if window is None:
            raise ValueError("--window-attn-skip-freq chooses which layers skip the sliding window: it needs "
                             "--window-size; add that or drop --window-attn-skip-freq")
        if isinstance(freq, int) and freq < 1:
            raise ValueError(f"--window-attn-skip-freq must be >= 1, got {freq}")
        if isinstance(freq, list):
            if len(freq) != config.num_layers or any(flag not in (0, 1) for flag in freq):
                raise ValueError(f"--window-attn-skip-freq as a list needs one 0 or 1 per layer ({config.num_layers} "
                                 f"for --num-layers), got {freq}")
            freq = tuple(freq)
    softmax_type = config.softmax_type
    if softmax_type not in SOFTMAX_TYPES:
        raise ValueError(f"--softmax-type must be one of {', '.join(SOFTMAX_TYPES)}, got {softmax_type!r}")
    if softmax_type != "vanilla" and config.apply_query_key_layer_scaling and config.fp16:
        raise ValueError(f"--softmax-type {softmax_type} does not implement --apply-query-key-layer-scaling's fp16 "
                         f"scores: drop one of the two flags")
    return window, freq

"""Query-key layer scaling (`--apply-query-key-layer-scaling`): attention for fp16 inputs whose scores are
computed as Q.K^T / (sqrt(d) * layer_number) in fp16, so that deep layers' large dot products stay inside
fp16's range, and multiplied back by the layer number in fp32 before the softmax. The softmax therefore sees
the usual Q.K^T / sqrt(d); only the fp16 intermediate is smaller. fp32 and bf16 inputs (bf16 has fp32's
range) take the ordinary attention, as upstream applies the scaling to fp16 only.
"""

import math

import torch

from megatron.core import tensor_parallel


def applies(config, query):
    return config.apply_query_key_layer_scaling and query.dtype == torch.float16


def layer_scaled_attention(query, key, value, attention_mask, layer_number, dropout_p):
    """`[b, heads, s, d]` queries, `[b, groups, s, d]` keys and values -> `[b, heads, s, d]`.

    `attention_mask` is None (causal) or a bool tensor broadcastable to `[b, heads, s, s]`, True where
    attention is not allowed (Megatron's convention)."""
    if layer_number < 1:
        raise ValueError(f"layer_number must be >= 1 (1-based), got {layer_number}")
    heads, groups = query.shape[1], key.shape[1]
    if groups != heads:
        key = key.repeat_interleave(heads // groups, dim=1)
        value = value.repeat_interleave(heads // groups, dim=1)
    coefficient = float(layer_number)
    batch, q_len, k_len = query.shape[0], query.shape[2], key.shape[2]
    # alpha scales the product inside the GEMM (fp32 accumulation), before it is rounded to fp16.
    scores = torch.baddbmm(
        torch.empty(batch * heads, q_len, k_len, dtype=query.dtype, device=query.device),
        query.reshape(batch * heads, q_len, -1), key.reshape(batch * heads, k_len, -1).transpose(1, 2),
        beta=0.0, alpha=1.0 / (math.sqrt(query.shape[-1]) * coefficient),
    ).view(batch, heads, q_len, k_len)
    scores = scores.float() * coefficient
    if attention_mask is None:
        attention_mask = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).triu(1)
    scores = scores.masked_fill(attention_mask.to(torch.bool), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        with tensor_parallel.get_cuda_rng_tracker().fork():
            probs = torch.nn.functional.dropout(probs, p=dropout_p)
    return torch.matmul(probs.to(value.dtype), value)

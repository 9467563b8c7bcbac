"""Context-parallel core attention: one entry point that dispatches on `--cp-comm-type`.

Inputs are this rank's tokens (its two load-balanced chunks, see `sequence_split`) in the attention module's
layout: query `[s/N, b, heads, d]`, key and value `[s/N, b, groups, d]`, RoPE already applied with global
positions. The result `[s/N, b, heads * d]` is exactly the rows of full attention over the whole sequence that
this rank holds.

Attention dropout: every comm type draws its masks from the tensor-parallel RNG tracker's stream, so they are
reproducible (activation recompute regenerates them) but not the masks a CP=1 run would draw for the same
tokens: a different, equally distributed sample.
"""

import contextlib
import math

import torch

from megatron.core import tensor_parallel
from megatron.core.transformer.context_parallel.a2a_attention import a2a_attention
from megatron.core.transformer.context_parallel.allgather_attention import allgather_attention
from megatron.core.transformer.context_parallel.ring_attention import RingAttention

CP_COMM_TYPES = ("p2p", "allgather", "a2a")
_ALIASES = {"all_gather": "allgather"}


def normalize_cp_comm_type(comm_type):
    """The canonical name of a comm type (upstream spells allgather both ways); ValueError naming the flag."""
    comm_type = _ALIASES.get(comm_type, comm_type)
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(f"--cp-comm-type must be one of {CP_COMM_TYPES} (or all_gather), got {comm_type!r}")
    return comm_type


def _ring_attention(query, key, value, group, mask, scale, dropout_p):
    seq, batch, heads, dim = query.shape
    groups = key.shape[2]
    q = query.permute(1, 2, 0, 3).reshape(batch, groups, heads // groups, seq, dim)
    k, v = (t.permute(1, 2, 0, 3).unsqueeze(2) for t in (key, value))
    if mask is not None:
        mask = mask.unsqueeze(2)  # [b|1, 1, 1, s, s] against [b, g, m, s, s]
    seed = 0
    if dropout_p > 0.0:
        seed = int(torch.randint(0, 2**40, (1,), device=query.device).item())
    out = RingAttention.apply(q, k, v, group, mask, scale, dropout_p, seed)
    return out.reshape(batch, heads, seq, dim).permute(2, 0, 1, 3)


_IMPLEMENTATIONS = {"p2p": _ring_attention, "allgather": allgather_attention, "a2a": a2a_attention}


def context_parallel_attention(query, key, value, attention_mask, *, comm_type, group, dropout_p=0.0,
                               scale=None):
    """Exact attention of this rank's queries over the whole sequence of the context-parallel `group`.

    `attention_mask`: None (causal) or a bool tensor broadcastable to `[b, 1, s, s]` over global positions (the
    whole sequence, not this rank's rows), True where attention is not allowed.
    """
    if attention_mask is not None:
        attention_mask = attention_mask.to(torch.bool)
        if attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
            raise ValueError("context parallelism takes an attention mask of shape [b or 1, 1, s, s] (one for all "
                             f"heads), got {tuple(attention_mask.shape)}")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    implementation = _IMPLEMENTATIONS[normalize_cp_comm_type(comm_type)]
    # Ranks hold different tokens and heads: draw dropout from the tracker's (reproducible) stream.
    rng = tensor_parallel.get_cuda_rng_tracker().fork() if dropout_p > 0.0 else contextlib.nullcontext()
    with rng:
        context = implementation(query, key, value, group, attention_mask, scale, dropout_p)
    seq, batch = context.shape[0], context.shape[1]
    return context.reshape(seq, batch, -1)

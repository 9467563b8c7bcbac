"""Context-parallel core attention: one entry point that dispatches on `--cp-comm-type`.

Inputs are this rank's tokens (its two load-balanced chunks, see `sequence_split`) in the attention module's
layout: query `[s/N, b, heads, d]`, key and value `[s/N, b, groups, d]`, RoPE already applied with global
positions. The result `[s/N, b, heads * d]` is exactly the rows of full attention over the whole sequence that
this rank holds. `s` must be divisible by 2N (an even `s/N`), as `get_batch_on_this_cp_rank` requires.

Attention sinks (`sinks`, one logit per local head): every comm type also returns the rows' log-sum-exp over
the whole sequence, and the sink rescales the output by sigmoid(lse - s_h) (`attention_variants.sink_rescaled`),
which is exact and carries the sinks' gradient; each rank's sink gradient covers its own rows, and the gradient
reduction over the context-parallel group sums them.

Attention dropout: every comm type draws its masks from the tensor-parallel RNG tracker's stream, so they are
reproducible (activation recompute regenerates them) but not the masks a CP=1 run would draw for the same
tokens: a different, equally distributed sample.
"""

import contextlib
import math

import torch
import torch.distributed as dist

from megatron.core import tensor_parallel
from megatron.core.transformer.attention_variants import sink_rescaled
from megatron.core.transformer.context_parallel.a2a_attention import a2a_attention
from megatron.core.transformer.context_parallel.allgather_attention import allgather_attention
from megatron.core.transformer.context_parallel.comm_types import HIERARCHICAL_COMM_TYPE, normalize_cp_comm_type
from megatron.core.transformer.context_parallel.hierarchical_attention import hierarchical_attention
from megatron.core.transformer.context_parallel.ring_attention import ring_attention
from megatron.core.transformer.context_parallel.sequence_split import check_divisible

_IMPLEMENTATIONS = {"p2p": ring_attention, "allgather": allgather_attention, "a2a": a2a_attention,
                    HIERARCHICAL_COMM_TYPE: hierarchical_attention}


def _check_local_sequence(local_seq_len, group):
    """The whole sequence's length; every comm type cuts a rank's tokens into its two equal load-balanced chunks,
    so an odd count is refused."""
    groups = group if isinstance(group, (tuple, list)) else (group,)
    cp_size = 1
    for member in groups:
        cp_size *= dist.get_world_size(member)
    check_divisible(local_seq_len * cp_size, cp_size)
    return local_seq_len * cp_size


def context_parallel_attention(query, key, value, attention_mask, *, comm_type, group, dropout_p=0.0,
                               scale=None, sinks=None):
    """Exact attention of this rank's queries over the whole sequence of the context-parallel `group`.

    `group` is the context-parallel process group, or for `a2a+p2p` the pair (inner all-to-all group, outer
    ring group) of parallel_state's hierarchical context-parallel groups.
    `attention_mask`: None (causal) or a bool tensor `[b or 1, 1, s, s]` over global positions (the whole
    sequence, not this rank's rows), True where attention is not allowed.
    `sinks`: None, or the attention sinks' logits `[heads]` of this rank's heads (see `attention_variants`).
    """
    if attention_mask is not None:
        attention_mask = attention_mask.to(torch.bool)
        if attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
            raise ValueError("context parallelism takes an attention mask of shape [b or 1, 1, s, s] (one for all "
                             f"heads), got {tuple(attention_mask.shape)}")
    comm_type = normalize_cp_comm_type(comm_type)
    if (comm_type == HIERARCHICAL_COMM_TYPE) != isinstance(group, (tuple, list)):
        raise ValueError(f"--cp-comm-type {comm_type} takes "
                         + ("the (inner, outer) pair of hierarchical context-parallel groups"
                            if comm_type == HIERARCHICAL_COMM_TYPE else "one context-parallel group"))
    seq_len = _check_local_sequence(query.shape[0], group)
    if attention_mask is not None and tuple(attention_mask.shape[-2:]) != (seq_len, seq_len):
        raise ValueError(
            f"context parallelism takes the attention mask of the whole sequence, [b or 1, 1, {seq_len}, {seq_len}], "
            f"got {tuple(attention_mask.shape)}: pass the mask unsplit (get_batch_on_this_cp_rank keeps it whole; "
            "upstream's version cuts its query rows, which this attention reads itself)"
        )
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    # Ranks hold different tokens and heads: draw dropout from the tracker's (reproducible) stream.
    rng = tensor_parallel.get_cuda_rng_tracker().fork() if dropout_p > 0.0 else contextlib.nullcontext()
    with rng:
        if sinks is None:
            context = _IMPLEMENTATIONS[comm_type](query, key, value, group, attention_mask, scale, dropout_p)
        else:
            context, lse = _IMPLEMENTATIONS[comm_type](query, key, value, group, attention_mask, scale, dropout_p,
                                                       with_lse=True)
            context = sink_rescaled(context, lse, sinks)
    seq, batch = context.shape[0], context.shape[1]
    return context.reshape(seq, batch, -1)

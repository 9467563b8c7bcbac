"""`--cp-comm-type a2a+p2p` (hierarchical context parallelism): Ulysses all-to-all inside the inner groups of
`--hierarchical-context-parallel-sizes`, a p2p ring across the outer groups.

With sizes (A, B), A * B = N, context-parallel rank r = o * A + i sits at position i of its inner (all-to-all)
group and position o of its outer (ring) group. The all-to-all gives each inner rank the tokens of the whole inner
group with 1/A of the heads. Those tokens are exactly the two load-balanced "super-chunks" of a ring over B ranks
with 2B chunks of A chunks each: super-chunk o is chunks (o*A, ..., o*A + A - 1), the first chunks of inner ranks
0..A-1, and super-chunk 2B-1-o is the second chunks of inner ranks A-1..0. So after reordering the gathered rows
into that order, the p2p ring over the outer group computes exact attention for them (causal masking, explicit
masks and load balance work unchanged), and the reverse reordering and all-to-all return this rank's rows (and,
when asked, the rows' log-sum-exps the ring computed, by the same way back).
"""

import torch
import torch.distributed as dist

from megatron.core.transformer.context_parallel.a2a_attention import check_heads_divisible
from megatron.core.transformer.context_parallel.collectives import HeadsToSequence, SequenceToHeads
from megatron.core.transformer.context_parallel.ring_attention import ring_attention


def super_chunk_order(inner_size, chunk, device=None):
    """Row index (into the all-to-all output: inner ranks in order, each `first chunk ++ second chunk`) of every
    row of the outer ring's local layout `super-chunk o ++ super-chunk 2B-1-o`."""
    firsts = [rank * 2 * chunk + torch.arange(chunk, device=device) for rank in range(inner_size)]
    seconds = [rank * 2 * chunk + chunk + torch.arange(chunk, device=device) for rank in reversed(range(inner_size))]
    return torch.cat(firsts + seconds)


def hierarchical_attention(query, key, value, groups, mask, scale, dropout_p, with_lse=False):
    """query `[s/N, b, H, d]`, key/value `[s/N, b, G, d]` -> `[s/N, b, H, d]`; `groups` is (inner all-to-all group,
    outer ring group); `mask` None (causal) or bool `[b|1, 1, s, s]` over global positions, True where masked.
    `with_lse`: also return each row's log-sum-exp over the whole sequence, fp32 `[s/N, b, H]` (differentiable)."""
    inner_group, outer_group = groups
    inner_size, inner_rank = dist.get_world_size(inner_group), dist.get_rank(inner_group)
    outer_size = dist.get_world_size(outer_group)
    check_heads_divisible(query.shape[2], key.shape[2], inner_size, flag="--hierarchical-context-parallel-sizes")
    order = super_chunk_order(inner_size, query.shape[0] // 2, query.device)
    q, k, v = (SequenceToHeads.apply(t, inner_group).index_select(0, order) for t in (query, key, value))
    # Inner ranks attend the same chunk pairs with different heads: their dropout masks must differ.
    seed_offset = inner_rank * (2 * outer_size) ** 2
    result = ring_attention(q, k, v, outer_group, mask, scale, dropout_p, seed_offset=seed_offset,
                            with_lse=with_lse)
    to_inner_order = torch.argsort(order)
    if not with_lse:
        return HeadsToSequence.apply(result.index_select(0, to_inner_order), inner_group)
    context, lse = result
    lse = HeadsToSequence.apply(lse.index_select(0, to_inner_order).unsqueeze(-1), inner_group).squeeze(-1)
    return HeadsToSequence.apply(context.index_select(0, to_inner_order), inner_group), lse

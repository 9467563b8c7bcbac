"""`--cp-comm-type a2a` (Ulysses): all-to-all from sequence sharding to head sharding, attention over the whole
sequence with this rank's heads, all-to-all back.

Query heads and key/value groups are each split into N contiguous blocks, so query head block j uses exactly key
group block j (GQA is preserved); this needs heads and groups (per tensor-parallel rank) divisible by N. The
gathered sequence arrives in rank order and is permuted to natural order, so the causal case runs the plain
causal kernel.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.transformer.context_parallel.allgather_attention import global_positions_in_rank_order
from megatron.core.transformer.context_parallel.collectives import HeadsToSequence, SequenceToHeads


def check_heads_divisible(num_heads, num_groups, cp_size, flag="--context-parallel-size"):
    """ValueError unless the heads and query groups of a tensor-parallel rank split over `cp_size` ranks (the
    all-to-all size: the context-parallel size, or the inner size named by `flag` under a2a+p2p)."""
    if num_heads % cp_size != 0 or num_groups % cp_size != 0:
        comm_type = "a2a+p2p" if flag != "--context-parallel-size" else "a2a"
        raise ValueError(
            f"--cp-comm-type {comm_type} splits attention heads over {flag} ({cp_size}): the heads "
            f"({num_heads}) and query groups ({num_groups}) of each tensor-parallel rank (--num-attention-heads, "
            "--num-query-groups / --tensor-model-parallel-size) must be divisible by it; use --cp-comm-type p2p"
        )


def a2a_attention(query, key, value, group, mask, scale, dropout_p):
    """query `[s/N, b, H, d]`, key/value `[s/N, b, G, d]` -> `[s/N, b, H, d]`; `mask` None (causal) or bool
    `[b|1, 1, s, s]` over global positions, True where masked."""
    cp_size = dist.get_world_size(group)
    check_heads_divisible(query.shape[2], key.shape[2], cp_size)
    seq_len = query.shape[0] * cp_size
    positions = global_positions_in_rank_order(seq_len, cp_size, query.device)
    to_natural = torch.argsort(positions)
    q, k, v = (SequenceToHeads.apply(t, group).index_select(0, to_natural).permute(1, 2, 0, 3)
               for t in (query, key, value))
    mask_kwargs = {"is_causal": True} if mask is None else {"attn_mask": ~mask}
    context = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1], **mask_kwargs)
    context = context.permute(2, 0, 1, 3).index_select(0, positions)  # back to rank order
    return HeadsToSequence.apply(context, group)

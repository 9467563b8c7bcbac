"""`--cp-comm-type allgather`: gather the whole K/V on every rank, then attend with this rank's queries.

The gathered keys are in rank order (each rank's two chunks), so the mask is built from global positions: key p
is visible to query q when p <= q (or as the explicit mask says). The backward of the gather sums the K/V
gradients over the group and keeps this rank's rows. Each rank attends s/N queries to all s keys (masked
entries included), the same work on every rank.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.transformer.context_parallel.collectives import AllGatherSequence
from megatron.core.transformer.context_parallel.sequence_split import local_token_indices


def global_positions_in_rank_order(seq_len, cp_size, device):
    return torch.cat([local_token_indices(seq_len, cp_size, rank, device) for rank in range(cp_size)])


def allgather_attention(query, key, value, group, mask, scale, dropout_p):
    """query `[s/N, b, H, d]`, key/value `[s/N, b, G, d]` -> `[s/N, b, H, d]`; `mask` None (causal) or bool
    `[b|1, 1, s, s]` over global positions, True where masked."""
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    seq_len = query.shape[0] * cp_size
    full_key = AllGatherSequence.apply(key, group)
    full_value = AllGatherSequence.apply(value, group)
    query_positions = local_token_indices(seq_len, cp_size, cp_rank, query.device)
    key_positions = global_positions_in_rank_order(seq_len, cp_size, query.device)
    if mask is None:
        masked = key_positions.unsqueeze(0) > query_positions.unsqueeze(1)
    else:
        masked = mask.index_select(-2, query_positions).index_select(-1, key_positions)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, full_key, full_value))
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=~masked, dropout_p=dropout_p, scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
    return context.permute(2, 0, 1, 3)

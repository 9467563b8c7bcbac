"""`--cp-comm-type a2a` (Ulysses): all-to-all from sequence sharding to head sharding, attention over the whole
sequence with this rank's heads, all-to-all back.

Query heads and key/value groups are each split into N contiguous blocks, so query head block j uses exactly key
group block j (GQA is preserved); this needs heads and groups (per tensor-parallel rank) divisible by N. The
gathered sequence arrives in rank order and is permuted to natural order, so the causal case runs the plain
causal kernel. When the caller needs each row's log-sum-exp (attention sinks), the attention of the rank's heads
runs as one block of `online_softmax` instead, which returns it; the lse goes back to sequence sharding with its
own all-to-all.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.transformer.context_parallel.allgather_attention import global_positions_in_rank_order
from megatron.core.transformer.context_parallel.collectives import HeadsToSequence, SequenceToHeads
from megatron.core.transformer.context_parallel.online_softmax import CAUSAL, BlockAttention


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


def _attention_with_lse(q, k, v, mask, scale, dropout_p, seed):
    """`[b, h, s, d]` queries, `[b, g, s, d]` keys and values -> (out `[b, h, s, d]`, fp32 lse `[b, h, s]`)."""
    batch, heads, seq, dim = q.shape
    groups = k.shape[1]
    block_mask = CAUSAL if mask is None else mask.unsqueeze(2)  # [b|1, 1, 1, s, s] against [b, g, m, s, s]
    out, lse = BlockAttention.apply(q.reshape(batch, groups, heads // groups, seq, dim), k.unsqueeze(2),
                                    v.unsqueeze(2), scale, block_mask, dropout_p, seed)
    return out.reshape(batch, heads, seq, -1), lse.reshape(batch, heads, seq)


def a2a_attention(query, key, value, group, mask, scale, dropout_p, with_lse=False):
    """query `[s/N, b, H, d]`, key/value `[s/N, b, G, d]` -> `[s/N, b, H, d]`; `mask` None (causal) or bool
    `[b|1, 1, s, s]` over global positions, True where masked. `with_lse`: also return each row's log-sum-exp
    over the whole sequence, fp32 `[s/N, b, H]` (differentiable)."""
    cp_size = dist.get_world_size(group)
    check_heads_divisible(query.shape[2], key.shape[2], cp_size)
    seq_len = query.shape[0] * cp_size
    positions = global_positions_in_rank_order(seq_len, cp_size, query.device)
    to_natural = torch.argsort(positions)
    q, k, v = (SequenceToHeads.apply(t, group).index_select(0, to_natural).permute(1, 2, 0, 3)
               for t in (query, key, value))
    if with_lse:
        seed = 0
        if dropout_p > 0.0:  # ranks hold different heads: their masks come from different seeds
            seed = int(torch.randint(0, 2**40, (1,), device=query.device).item()) + dist.get_rank(group)
        context, lse = _attention_with_lse(q, k, v, mask, scale, dropout_p, seed)
        lse = lse.permute(2, 0, 1).index_select(0, positions).unsqueeze(-1)  # [s, b, H/N, 1] in rank order
        lse = HeadsToSequence.apply(lse, group).squeeze(-1)
    else:
        mask_kwargs = {"is_causal": True} if mask is None else {"attn_mask": ~mask}
        context = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale,
                                                 enable_gqa=k.shape[1] != q.shape[1], **mask_kwargs)
    context = context.permute(2, 0, 1, 3).index_select(0, positions)  # back to rank order
    context = HeadsToSequence.apply(context, group)
    return (context, lse) if with_lse else context

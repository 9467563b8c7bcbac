"""`--cp-comm-type allgather`: gather the whole K/V on every rank, then attend with this rank's queries.

The gathered keys are in rank order (each rank's two chunks), so the mask is built from global positions: key p
is visible to query q when p <= q (or as the explicit mask says). Each rank attends s/N queries to all s keys
(masked entries included), the same work on every rank.

Activations kept for backward: this rank's Q, K, V, output and log-sum-exp only (1/N of the sequence), not the
gathered K/V: the backward gathers K/V again, computes the gradients from the saved lse (see `online_softmax`)
and reduce-scatters the K/V gradients to the ranks that own the rows. The causal mask is rebuilt from positions.
"""

import torch
import torch.distributed as dist

from megatron.core.transformer.context_parallel.collectives import all_gather_first_dim, reduce_scatter_first_dim
from megatron.core.transformer.context_parallel.online_softmax import block_backward, block_forward, row_delta
from megatron.core.transformer.context_parallel.sequence_split import local_token_indices


def global_positions_in_rank_order(seq_len, cp_size, device):
    return torch.cat([local_token_indices(seq_len, cp_size, rank, device) for rank in range(cp_size)])


def _visibility_mask(mask, seq_len, cp_size, cp_rank, device):
    """True where masked, `[s/N, s]` (causal) or `[b|1, 1, 1, s/N, s]` (explicit), keys in rank order."""
    query_positions = local_token_indices(seq_len, cp_size, cp_rank, device)
    key_positions = global_positions_in_rank_order(seq_len, cp_size, device)
    if mask is None:
        return key_positions.unsqueeze(0) > query_positions.unsqueeze(1)
    return mask.index_select(-2, query_positions).index_select(-1, key_positions).unsqueeze(2)


def _gather_key_value(key, value, group):
    """`[s, b, G, d]` key and value of the whole sequence, in the `[b, G, 1, s, d]` block layout."""
    gathered = all_gather_first_dim(torch.stack([key, value], dim=1), group)  # [s, 2, b, G, d]
    return tuple(gathered[:, index].permute(1, 2, 0, 3).unsqueeze(2) for index in (0, 1))


class AllGatherAttention(torch.autograd.Function):
    """q `[b, g, m, s/N, d]`, local key and value `[s/N, b, g, d]` -> (out `[b, g, m, s/N, d]`, fp32 lse
    `[b, g, m, s/N]` over the whole sequence)."""

    @staticmethod
    def forward(ctx, query, key, value, group, mask, scale, dropout_p, seed):
        ctx.set_materialize_grads(False)
        cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        seq_len = query.shape[-2] * cp_size
        full_key, full_value = _gather_key_value(key, value, group)
        block_mask = _visibility_mask(mask, seq_len, cp_size, cp_rank, query.device)
        out, lse = block_forward(query, full_key, full_value, scale, block_mask, dropout_p, seed)
        del full_key, full_value, block_mask
        ctx.save_for_backward(query, key, value, out, lse, mask if mask is not None else torch.empty(0))
        ctx.has_mask, ctx.group, ctx.scale, ctx.dropout_p, ctx.seed = mask is not None, group, scale, dropout_p, seed
        return out.to(query.dtype), lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        query, key, value, out, lse, mask = ctx.saved_tensors
        group = ctx.group
        cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        full_key, full_value = _gather_key_value(key, value, group)
        block_mask = _visibility_mask(mask if ctx.has_mask else None, query.shape[-2] * cp_size, cp_size, cp_rank,
                                      query.device)
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out.to(out.dtype)
        delta = row_delta(grad_out, out, grad_lse)
        grad_query, grad_key, grad_value = block_backward(query, full_key, full_value, grad_out, lse, delta,
                                                          ctx.scale, block_mask, ctx.dropout_p, ctx.seed)
        # [b, g, 1, s, d] -> [s, 2, b, g, d], summed over ranks, this rank's rows kept.
        grads = torch.stack([grad_key, grad_value]).squeeze(3).permute(3, 0, 1, 2, 4)
        local = reduce_scatter_first_dim(grads, group)
        return (grad_query.to(query.dtype), local[:, 0].to(key.dtype), local[:, 1].to(value.dtype),
                None, None, None, None, None)


def allgather_attention(query, key, value, group, mask, scale, dropout_p, with_lse=False):
    """query `[s/N, b, H, d]`, key/value `[s/N, b, G, d]` -> `[s/N, b, H, d]`; `mask` None (causal) or bool
    `[b|1, 1, s, s]` over global positions, True where masked. `with_lse`: also return each row's log-sum-exp
    over the whole sequence, fp32 `[s/N, b, H]` (differentiable)."""
    seq, batch, heads, dim = query.shape
    groups = key.shape[2]
    q = query.permute(1, 2, 0, 3).reshape(batch, groups, heads // groups, seq, dim)
    seed = 0
    if dropout_p > 0.0:  # ranks hold different query rows: their masks come from different seeds
        seed = int(torch.randint(0, 2**40, (1,), device=query.device).item()) + dist.get_rank(group)
    out, lse = AllGatherAttention.apply(q, key, value, group, mask, scale, dropout_p, seed)
    out = out.reshape(batch, heads, seq, dim).permute(2, 0, 1, 3)
    return (out, lse.reshape(batch, heads, seq).permute(2, 0, 1)) if with_lse else out

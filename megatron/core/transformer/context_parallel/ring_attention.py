"""`--cp-comm-type p2p`: ring attention. K/V travel around the context-parallel group while each rank attends
with its own queries to the block it holds, merging partial outputs by their log-sum-exps.

Rank r holds query chunks (r, 2N-1-r) and at ring step t the K/V chunks of rank r - t. Under causal masking a
(query chunk a, key chunk c) pair is skipped when c > a (every key is in the future), attended with a diagonal
mask when c == a, and attended whole when c < a; with the load-balanced split each rank attends the same number
of pairs. With an explicit attention mask every pair is attended under its slice of the mask.

The backward is a second ring: K/V travel again, each rank adds its (dK, dV) of the block it holds to an
accumulator that travels with the block, and after N hops every accumulator is back at the rank that owns the
block. The next block's send is started before the current block is computed, so transfer overlaps compute.
Activations kept for backward: this rank's Q, K, V, output and lse only.
"""

import torch
import torch.distributed as dist

from megatron.core.transformer.context_parallel.collectives import RingExchange
from megatron.core.transformer.context_parallel.online_softmax import (
    CAUSAL,
    block_backward,
    block_forward,
    merge,
    row_delta,
)
from megatron.core.transformer.context_parallel.sequence_split import chunk_ids_for_rank

_SKIP = object()


def _block_mask(mask, query_chunk, key_chunk, chunk):
    """The mask of one (query chunk, key chunk) pair: _SKIP, CAUSAL, None or a slice of the explicit mask."""
    if mask is None:
        if key_chunk > query_chunk:
            return _SKIP
        return CAUSAL if key_chunk == query_chunk else None
    rows = slice(query_chunk * chunk, (query_chunk + 1) * chunk)
    cols = slice(key_chunk * chunk, (key_chunk + 1) * chunk)
    return mask[..., rows, cols]


def attended_pairs(cp_size, cp_rank, causal=True):
    """[(step, query chunk, key chunk)] this rank attends, in order (the work balance is read from this)."""
    pairs = []
    for step in range(cp_size):
        source = (cp_rank - step) % cp_size
        for query_chunk in chunk_ids_for_rank(cp_size, cp_rank):
            for key_chunk in chunk_ids_for_rank(cp_size, source):
                if not causal or key_chunk <= query_chunk:
                    pairs.append((step, query_chunk, key_chunk))
    return pairs


def _halves(tensor, chunk):
    return tensor[..., :chunk, :], tensor[..., chunk:, :]


def _block_calls(cp_size, cp_rank, step, mask, chunk):
    """(query half, key half, block mask, pair id) of every pair this rank attends at `step`."""
    source = (cp_rank - step) % cp_size
    for query_half, query_chunk in enumerate(chunk_ids_for_rank(cp_size, cp_rank)):
        for key_half, key_chunk in enumerate(chunk_ids_for_rank(cp_size, source)):
            block_mask = _block_mask(mask, query_chunk, key_chunk, chunk)
            if block_mask is not _SKIP:
                yield query_half, key_half, block_mask, query_chunk * 2 * cp_size + key_chunk


class RingAttention(torch.autograd.Function):
    """q `[b, g, m, s_local, d]`, k and v `[b, g, 1, s_local, d]` -> (out like q, fp32 lse `[b, g, m, s_local]`
    over the whole sequence). `mask` is None (causal) or a bool tensor `[b|1, 1, 1, s, s]` over global
    positions, True where masked."""

    @staticmethod
    def forward(ctx, query, key, value, group, mask, scale, dropout_p, seed):
        ctx.set_materialize_grads(False)
        cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        chunk = query.shape[-2] // 2
        queries = _halves(query, chunk)
        outs, lses = [None, None], [None, None]
        key_value = torch.stack([key, value])
        for step in range(cp_size):
            exchange = RingExchange(group).start(key_value) if step < cp_size - 1 else None
            keys, values = _halves(key_value[0], chunk), _halves(key_value[1], chunk)
            for query_half, key_half, block_mask, pair in _block_calls(cp_size, cp_rank, step, mask, chunk):
                block_out, block_lse = block_forward(queries[query_half], keys[key_half], values[key_half], scale,
                                                     block_mask, dropout_p, seed + pair)
                outs[query_half], lses[query_half] = merge(outs[query_half], lses[query_half], block_out, block_lse)
            if exchange is not None:
                key_value = exchange.wait()
        out, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
        ctx.save_for_backward(query, key, value, out, lse, mask if mask is not None else torch.empty(0))
        ctx.has_mask, ctx.group, ctx.scale, ctx.dropout_p, ctx.seed = mask is not None, group, scale, dropout_p, seed
        return out.to(query.dtype), lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        query, key, value, out, lse, mask = ctx.saved_tensors
        mask = mask if ctx.has_mask else None
        group = ctx.group
        cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        chunk = query.shape[-2] // 2
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out.to(out.dtype)
        delta = row_delta(grad_out, out, grad_lse)
        queries, grad_outs = _halves(query, chunk), _halves(grad_out, chunk)
        lses, deltas = (lse[..., :chunk], lse[..., chunk:]), (delta[..., :chunk], delta[..., chunk:])
        grad_query = torch.zeros_like(query, dtype=out.dtype)
        grad_queries = _halves(grad_query, chunk)
        key_value = torch.stack([key, value])
        grad_key_value = torch.zeros_like(key_value, dtype=out.dtype)
        for step in range(cp_size):
            exchange = RingExchange(group).start(key_value) if step < cp_size - 1 else None
            keys, values = _halves(key_value[0], chunk), _halves(key_value[1], chunk)
            grad_keys, grad_values = _halves(grad_key_value[0], chunk), _halves(grad_key_value[1], chunk)
            for query_half, key_half, block_mask, pair in _block_calls(cp_size, cp_rank, step, mask, chunk):
                dq, dk, dv = block_backward(queries[query_half], keys[key_half], values[key_half],
                                            grad_outs[query_half], lses[query_half], deltas[query_half],
                                            ctx.scale, block_mask, ctx.dropout_p, ctx.seed + pair)
                grad_queries[query_half].add_(dq)
                grad_keys[key_half].add_(dk)
                grad_values[key_half].add_(dv)
            if exchange is not None:
                key_value = exchange.wait()
            # The accumulator follows its block; after the last hop it is back at the block's owner.
            grad_key_value = RingExchange(group).start(grad_key_value).wait()
        return (grad_query.to(query.dtype), grad_key_value[0].to(key.dtype), grad_key_value[1].to(value.dtype),
                None, None, None, None, None)


def ring_attention(query, key, value, group, mask, scale, dropout_p, seed_offset=0, with_lse=False):
    """query `[s/N, b, H, d]`, key/value `[s/N, b, G, d]` -> `[s/N, b, H, d]` in the attention module's layout;
    `mask` None (causal) or bool `[b|1, 1, s, s]` over global positions, True where masked. `seed_offset` keeps
    the dropout masks of ranks that attend the same chunk pairs with other heads apart (hierarchical CP).
    `with_lse`: also return each row's log-sum-exp over the whole sequence, fp32 `[s/N, b, H]` (differentiable)."""
    seq, batch, heads, dim = query.shape
    groups = key.shape[2]
    q = query.permute(1, 2, 0, 3).reshape(batch, groups, heads // groups, seq, dim)
    k, v = (t.permute(1, 2, 0, 3).unsqueeze(2) for t in (key, value))
    if mask is not None:
        mask = mask.unsqueeze(2)  # [b|1, 1, 1, s, s] against [b, g, m, s, s]
    seed = 0
    if dropout_p > 0.0:
        seed = int(torch.randint(0, 2**40, (1,), device=query.device).item()) + seed_offset
    out, lse = RingAttention.apply(q, k, v, group, mask, scale, dropout_p, seed)
    out = out.reshape(batch, heads, seq, dim).permute(2, 0, 1, 3)
    return (out, lse.reshape(batch, heads, seq).permute(2, 0, 1)) if with_lse else out

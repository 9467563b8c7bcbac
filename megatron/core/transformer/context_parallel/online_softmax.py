"""Attention over one block of keys, returning the log-sum-exp of its scores, and the merge of partial results.

Splitting the keys of a softmax into blocks and merging the partial outputs with their log-sum-exps is exact:
with `out_i = softmax(S_i) V_i` and `lse_i = logsumexp(S_i)` per block, the full attention is
`sum_i exp(lse_i - lse) out_i` with `lse = logsumexp_i(lse_i)`. The backward of a block needs only the final
output and lse (FlashAttention's recurrence): `P = exp(S - lse)`, `dV = P^T dO`, `dS = P * (dO V^T - D)` with
`D = rowsum(dO * O)`, `dQ = dS K scale`, `dK = dS^T Q scale` (dropout multiplies P and dO V^T by the same keep
mask / (1 - p)).

Layout: queries `[b, g, m, s_q, d]` (g key/value groups, m query heads per group), keys and values
`[b, g, 1, s_k, d]`, so grouped-query attention broadcasts without copying K/V. A block mask is None (every key
visible), `CAUSAL` (a diagonal block: key j visible to query i when j <= i) or a bool tensor broadcastable to
`[b, g, m, s_q, s_k]`, True where attention is not allowed. Everything is computed in fp32 (fp64 inputs in fp64).

The lse of the whole row may itself be an output (attention sinks rescale the output by it): since
`d lse / dS = P`, its gradient g enters the same recurrence as `dS = P * (dO V^T - (D - g))`, so the backwards
take `delta = D - g` (`row_delta`).
"""

import torch

CAUSAL = "causal"


def compute_dtype(tensor):
    """fp32 for half-precision and fp32 inputs, fp64 for fp64 ones (no precision is lost to the merge)."""
    return torch.promote_types(tensor.dtype, torch.float32)


def _masked_scores(query, key, scale, mask):
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if mask is None:
        return scores
    if isinstance(mask, str):
        s_q, s_k = scores.shape[-2:]
        mask = torch.ones(s_q, s_k, dtype=torch.bool, device=scores.device).triu_(1 + s_k - s_q)
    return scores.masked_fill(mask, float("-inf"))


def _finite(lse):
    """lse with -inf (rows that see no key) replaced by 0, so that exp(scores - lse) is 0 there, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def dropout_keep_mask(shape, dropout_p, seed, device):
    """The keep mask of one block, regenerated identically in backward from its seed."""
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed))
    return torch.rand(shape, generator=generator, device=device) >= dropout_p


def block_forward(query, key, value, scale, mask=None, dropout_p=0.0, seed=None):
    """(out `[b, g, m, s_q, d]`, lse `[b, g, m, s_q]`) of the queries over this block of keys."""
    dtype = compute_dtype(query)
    scores = _masked_scores(query.to(dtype), key.to(dtype), scale, mask)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    if dropout_p > 0.0:
        probs = probs * dropout_keep_mask(probs.shape, dropout_p, seed, probs.device) / (1.0 - dropout_p)
    return torch.matmul(probs, value.to(dtype)), lse


def block_backward(query, key, value, grad_out, lse, delta, scale, mask=None, dropout_p=0.0, seed=None):
    """(dq, dk, dv) of one block given the final (merged) `lse` and `delta = rowsum(grad_out * out)`."""
    dtype = compute_dtype(query)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    probs = torch.exp(_masked_scores(query, key, scale, mask) - _finite(lse).unsqueeze(-1))
    grad_probs = torch.matmul(grad_out, value.transpose(-1, -2))
    if dropout_p > 0.0:
        keep = dropout_keep_mask(probs.shape, dropout_p, seed, probs.device) / (1.0 - dropout_p)
        dropped = probs * keep
        grad_probs = grad_probs * keep
    else:
        dropped = probs
    grad_value = torch.matmul(dropped.transpose(-1, -2), grad_out).sum(dim=2, keepdim=True)
    grad_scores = probs * (grad_probs - delta.unsqueeze(-1))
    grad_query = torch.matmul(grad_scores, key) * scale
    grad_key = torch.matmul(grad_scores.transpose(-1, -2), query).sum(dim=2, keepdim=True) * scale
    return grad_query, grad_key, grad_value


def row_delta(grad_out, out, grad_lse=None):
    """`D = rowsum(dO * O)`, less the gradient of the returned lse when it has one (in `out`'s dtype)."""
    delta = (grad_out.to(out.dtype) * out).sum(dim=-1)
    return delta if grad_lse is None else delta - grad_lse.to(out.dtype)


class BlockAttention(torch.autograd.Function):
    """(out, lse) of the queries over all the keys in one block, with the recomputing backward above: q
    `[b, g, m, s_q, d]`, k and v `[b, g, 1, s_k, d]`, `mask` as for `block_forward`. For a comm type that holds
    the whole sequence (a2a) and must return the lse."""

    @staticmethod
    def forward(ctx, query, key, value, scale, mask, dropout_p, seed):
        ctx.set_materialize_grads(False)
        out, lse = block_forward(query, key, value, scale, mask, dropout_p, seed)
        tensor_mask = isinstance(mask, torch.Tensor)
        ctx.save_for_backward(query, key, value, out, lse, mask if tensor_mask else torch.empty(0))
        ctx.tensor_mask, ctx.scale, ctx.dropout_p, ctx.seed = tensor_mask, scale, dropout_p, seed
        ctx.mask = None if tensor_mask else mask  # None or CAUSAL
        return out.to(query.dtype), lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        query, key, value, out, lse, mask = ctx.saved_tensors
        mask = mask if ctx.tensor_mask else ctx.mask
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        grad_out = grad_out.to(out.dtype)
        grad_query, grad_key, grad_value = block_backward(query, key, value, grad_out, lse,
                                                          row_delta(grad_out, out, grad_lse), ctx.scale, mask,
                                                          ctx.dropout_p, ctx.seed)
        return (grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype),
                None, None, None, None)


def merge(out, lse, block_out, block_lse):
    """Fold one block's (out, lse) into the running pair (None, None to start)."""
    if out is None:
        return block_out, block_lse
    merged_lse = torch.logaddexp(lse, block_lse)
    finite = _finite(merged_lse)
    merged = out * torch.exp(lse - finite).unsqueeze(-1) + block_out * torch.exp(block_lse - finite).unsqueeze(-1)
    return merged, merged_lse

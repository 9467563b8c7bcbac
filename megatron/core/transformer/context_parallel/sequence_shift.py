"""Shifting a token-indexed tensor to the left along the whole sequence when each context-parallel rank holds two
load-balanced chunks of it (`sequence_split`: rank i holds chunks i and 2N-1-i of 2N).

Shifted left by k (at most one chunk length c), chunk j keeps its last c - k elements and is completed by the first
k elements of chunk j + 1, which another rank may hold; the last chunk of the sequence is completed by `fill`, as
the shift of the whole sequence fills its end. One all-gather over the group of every rank's two chunk heads
(`[2, ..., k]` each) gives each rank the heads it needs. A longer shift is done in steps of at most one chunk.

The result equals shifting the full sequence and then cutting it for the rank (`local_rows`). It is meant for data
(token ids, labels, loss masks, position ids): no gradient flows through the exchange.
"""

import torch
import torch.distributed as dist

from megatron.core.transformer.context_parallel.sequence_split import chunk_ids_for_rank


def shift_left_across_cp_ranks(tensor: torch.Tensor, shift: int, group, fill=0) -> torch.Tensor:
    """This rank's part (`[..., s / N]`, its two chunks in local order) of the full sequence (`[..., s]`) shifted
    `shift` positions to the left along the last dim, the last `shift` positions of the sequence set to `fill`.
    Collective over `group` (the context-parallel group, size N): every rank must call it with the same shift."""
    if shift < 0:
        raise ValueError(f"the context-parallel shift must be >= 0, got {shift}")
    if tensor.requires_grad:
        raise ValueError("shift_left_across_cp_ranks moves data (ids, labels, masks) without gradients: pass a "
                         "tensor that does not require grad")
    local_len = tensor.shape[-1]
    if local_len % 2 != 0:
        raise ValueError(f"a context-parallel rank holds two equal chunks, but the local sequence length is "
                         f"{local_len} (odd)")
    cp_rank = dist.get_rank(group)
    chunk = local_len // 2
    remaining = shift
    while remaining > 0 and chunk > 0:
        step = min(remaining, chunk)
        tensor = _shift_within_one_chunk(tensor, step, cp_rank, group, fill)
        remaining -= step
    return tensor


def _shift_within_one_chunk(tensor, step, cp_rank, group, fill):
    """One step of at most a chunk: each chunk drops its first `step` elements and takes the next chunk's."""
    every_ranks_heads = _all_gather(chunk_heads(tensor, step), group)
    return join_shifted_chunks(tensor, step, every_ranks_heads, cp_rank, fill)


def chunk_heads(tensor: torch.Tensor, step: int) -> torch.Tensor:
    """`[2, ..., step]`: the first `step` elements of this rank's two chunks (`tensor`: `[..., 2c]`), in local
    order; what the ranks exchange for a shift by `step` <= c."""
    chunk = tensor.shape[-1] // 2
    return torch.stack([tensor[..., :step], tensor[..., chunk:chunk + step]]).contiguous()


def join_shifted_chunks(tensor, step, every_ranks_heads, cp_rank, fill=0) -> torch.Tensor:
    """This rank's `tensor` shifted left by `step` (<= a chunk) along the whole sequence, given every rank's
    `chunk_heads` in group rank order (pure indexing: the exchange is the caller's)."""
    cp_size = len(every_ranks_heads)
    chunk = tensor.shape[-1] // 2

    def head_of(chunk_id):
        if chunk_id == 2 * cp_size:  # past the end of the sequence
            return torch.full_like(every_ranks_heads[0][0], fill)
        if chunk_id < cp_size:  # a rank's first chunk: held by rank chunk_id, slot 0
            return every_ranks_heads[chunk_id][0]
        return every_ranks_heads[2 * cp_size - 1 - chunk_id][1]  # a rank's second chunk: slot 1

    first, second = chunk_ids_for_rank(cp_size, cp_rank)
    return torch.cat([tensor[..., step:chunk], head_of(first + 1), tensor[..., chunk + step:], head_of(second + 1)],
                     dim=-1)


def _all_gather(tensor, group):
    """Every rank's `tensor`, in group rank order (bool travels as uint8: not every backend gathers bool)."""
    send = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor
    received = [torch.empty_like(send) for _ in range(dist.get_world_size(group))]
    dist.all_gather(received, send, group=group)
    return [part.to(tensor.dtype) for part in received]

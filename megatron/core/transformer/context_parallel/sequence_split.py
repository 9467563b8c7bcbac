"""Which tokens of a sequence each context-parallel rank holds: pure index arithmetic, no communication.

Under causal masking a token attends to every token before it, so the attention work of a contiguous slice grows
with its position. Context parallelism therefore cuts the sequence into 2N equal chunks and gives rank i the
chunks i and 2N-1-i: every rank holds one early and one late chunk, and the work per rank is equal. The local
sequence of rank i is `chunk i ++ chunk 2N-1-i`; every tensor that is indexed by token (tokens, labels, loss
mask, position ids, RoPE angles) is cut the same way so that each local token keeps its global position.
"""

import torch
import torch.distributed as dist

# Batch entries whose sequence dimension is not dimension 1 of a `[b, s]` tensor.
_SEQUENCE_DIM = {"attention_mask": None}  # kept whole: every comm type reads the key columns it needs


def chunk_ids_for_rank(cp_size: int, cp_rank: int) -> tuple:
    """The two chunks (of 2 * cp_size) that `cp_rank` holds, in local order."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"context-parallel rank {cp_rank} is outside [0, {cp_size})")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def check_divisible(seq_len: int, cp_size: int):
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(
            f"sequence length {seq_len} must be divisible by 2 x --context-parallel-size ({2 * cp_size}): "
            "each rank holds two of 2 x CP equal chunks (change --seq-length)"
        )


def local_token_indices(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions of the `seq_len / cp_size` tokens this rank holds, in local order."""
    check_divisible(seq_len, cp_size)
    chunk = seq_len // (2 * cp_size)
    first, second = chunk_ids_for_rank(cp_size, cp_rank)
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])


def local_rows(tensor: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's slice of `tensor` along its (global) sequence dimension `dim`."""
    if cp_size == 1:
        return tensor
    seq_len = tensor.shape[dim]
    check_divisible(seq_len, cp_size)
    chunk = seq_len // (2 * cp_size)
    first, second = chunk_ids_for_rank(cp_size, cp_rank)
    return torch.cat([tensor.narrow(dim, first * chunk, chunk), tensor.narrow(dim, second * chunk, chunk)], dim=dim)


def get_batch_on_this_cp_rank(batch: dict, cp_size: int = None, cp_rank: int = None, *, cp_group=None) -> dict:
    """This rank's share of a micro-batch: `[b, s]` entries (tokens, labels, loss_mask, position_ids) cut to the
    rank's two chunks along dimension 1. As upstream, `batch` itself is updated and returned.

    An `attention_mask` (`[b, 1, s, s]`, True where masked) stays whole: it is indexed by global positions inside
    the context-parallel attention, where each comm type reads the query rows and key columns it needs.
    Entries without a sequence dimension (a blend's per-sample `dataset_id`, `[b]`) and values that are not
    tensors (None, names, counts) pass through whole. The sizes come from `cp_group` (upstream's keyword), else
    from `cp_size` / `cp_rank`, else from parallel_state's context-parallel group.
    """
    if cp_group is not None:
        if cp_size is not None or cp_rank is not None:
            raise ValueError("get_batch_on_this_cp_rank: pass either cp_group or cp_size and cp_rank, not both")
        cp_size, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    elif cp_size is None or cp_rank is None:
        from megatron.core import parallel_state

        cp_size = parallel_state.get_context_parallel_world_size()
        cp_rank = parallel_state.get_context_parallel_rank()
    if cp_size == 1:
        return batch
    for key, value in list(batch.items()):
        if not isinstance(value, torch.Tensor) or key in _SEQUENCE_DIM or value.dim() < 2:
            continue
        if value.shape[1] % (2 * cp_size) != 0:
            raise ValueError(
                f"batch[{key!r}] has sequence length {value.shape[1]} (dimension 1 of {tuple(value.shape)}), which "
                f"must be divisible by 2 x --context-parallel-size ({2 * cp_size}): each rank holds two of 2 x CP "
                "equal chunks (change --seq-length, or pad the sequences to a multiple)"
            )
        batch[key] = local_rows(value, 1, cp_size, cp_rank)
    return batch

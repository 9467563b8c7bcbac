"""`finalize_model_grads`: everything that must happen to gradients between the last backward and the step.

1. finish the data-parallel reduction of every model chunk that has one (DDP, Megatron-FSDP);
2. all-reduce gradients of sequence-parallel parameters (norms) over the tensor-parallel group: each TP rank
   saw only its slice of the sequence;
3. all-reduce gradients of the embedding shared by the first and last pipeline stages over the embedding group;
4. with `num_tokens` (per-token loss), divide all gradients by the token count summed over data parallel.
Works on DDP chunks (`param.main_grad`), Megatron-FSDP chunks (gradients in its buffers, reached through
`optimizer_grad_pieces()`), FSDP2 chunks and plain modules (`param.grad`, reduced locally as a DTensor shard when
the gradient is a DTensor).

Under Megatron-FSDP each rank holds a piece of each parameter's reduced gradient. Sequence-parallel parameters
are laid out identically on every TP rank (same module structure, same shapes), so the pieces of one TP group
cover the same elements and are all-reduced as they are. The tied embedding's pieces are its rows chunked over
the data-parallel ranks, whatever group it sits in, so the first and last stage's ranks of one embedding group
hold the same elements too: their pieces are all-reduced over the embedding group as they are (one all-reduce
of 1/DP of the gradient; checked once per chunk). Only where the pieces differ (HFSDP cuts flat sub-shards of a
whole group) each stage assembles the full gradient over the ranks that hold its pieces, the two stages sum it
over the embedding group, and each rank keeps its piece.
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.device_utils import get_device_for_group
from megatron.core.distributed.data_parallel_base import DataParallelWrapper, local_tensor
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import MegatronFSDPAdapter
from megatron.core.timers import timed


def _grad_of(param):
    main_grad = getattr(param, "main_grad", None)
    grad = main_grad if main_grad is not None else param.grad
    return None if grad is None else local_tensor(grad)


def _params_with(model_chunks, attribute):
    params, seen = [], set()
    for chunk in model_chunks:
        for param in chunk.parameters():
            if param.requires_grad and getattr(param, attribute, False) and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


@torch.no_grad()
def _all_reduce_grads(params, group):
    """One all-reduce of the concatenated gradients of `params` over `group`."""
    grads = [grad for grad in (_grad_of(param) for param in params) if grad is not None]
    if not grads:
        return
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def _is_megatron_fsdp(chunk):
    return isinstance(chunk, MegatronFSDPAdapter)


def _has_attribute(attribute):
    return lambda param: bool(getattr(param, attribute, False))


@torch.no_grad()
def _all_reduce_tensors(tensors, group):
    """One all-reduce of the concatenation of `tensors` over `group`, written back in place."""
    tensors = [tensor for tensor in tensors if tensor.numel() > 0]
    if not tensors:
        return
    flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


@torch.no_grad()
def _all_reduce_sharded_grads(chunk, predicate, group):
    """All-reduce over `group` the full gradients of a Megatron-FSDP chunk's parameters chosen by `predicate`,
    whatever piece of them each rank holds: assemble them over the chunk's shard groups (zeros elsewhere),
    all-reduce over `group`, keep this rank's pieces."""
    pieces = chunk.optimizer_grad_pieces(predicate)
    if not pieces:
        return
    dtype = pieces[0].grad.dtype
    offsets, total = [], 0
    for piece in pieces:
        offsets.append(total)
        total += piece.param.numel()
    full = torch.zeros(total, dtype=dtype, device=pieces[0].grad.device)
    for offset, piece in zip(offsets, pieces):
        full[offset + piece.param_start:offset + piece.param_end].copy_(piece.grad.reshape(-1))
    for shard_group in chunk.grad_shard_groups():
        dist.all_reduce(full, group=shard_group)
    dist.all_reduce(full, group=group)
    for offset, piece in zip(offsets, pieces):
        piece.grad.copy_(full[offset + piece.param_start:offset + piece.param_end].view_as(piece.grad))


def _allreduce_sequence_parallel_grads(model_chunks):
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    group = parallel_state.get_tensor_model_parallel_group()
    plain_chunks = [chunk for chunk in model_chunks if not _is_megatron_fsdp(chunk)]
    _all_reduce_grads(_params_with(plain_chunks, "sequence_parallel"), group)
    for chunk in model_chunks:
        if _is_megatron_fsdp(chunk):
            pieces = chunk.optimizer_grad_pieces(_has_attribute("sequence_parallel"))
            _all_reduce_tensors([piece.grad for piece in pieces], group)


def _allreduce_shared_embedding_grads(model_chunks):
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    if not parallel_state.is_rank_in_embedding_group():
        return
    group = parallel_state.get_embedding_group()
    if group is None or dist.get_world_size(group) == 1:
        return
    # With an interleaved pipeline the embedding lives in the first chunk of the first stage and the output layer
    # in the last chunk of the last stage: exactly one chunk per rank takes part, as the collectives below need.
    if len(model_chunks) > 1:
        if parallel_state.is_pipeline_first_stage(ignore_virtual=True):
            model_chunks = model_chunks[:1]
        elif parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            model_chunks = model_chunks[-1:]
    plain_chunks = [chunk for chunk in model_chunks if not _is_megatron_fsdp(chunk)]
    _all_reduce_grads(_params_with(plain_chunks, "shared_embedding"), group)
    for chunk in model_chunks:
        if _is_megatron_fsdp(chunk):
            pieces = chunk.optimizer_grad_pieces(_has_attribute("shared_embedding"))
            if _pieces_match_across(chunk, pieces, group):
                _all_reduce_tensors([piece.grad for piece in pieces], group)
            else:
                _all_reduce_sharded_grads(chunk, _has_attribute("shared_embedding"), group)


def _pieces_match_across(chunk, pieces, group):
    """Whether every rank of `group` holds the same elements of the same parameters (compared once per chunk
    and group, then cached on the chunk: the layout does not change during training)."""
    cache = chunk.__dict__.setdefault("_shared_embedding_pieces_match", {})
    key = id(group)
    if key not in cache:
        bounds = [(tuple(piece.param.shape), piece.param_start, piece.param_end) for piece in pieces]
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, bounds, group=group)
        cache[key] = all(other == bounds for other in gathered)
    return cache[key]


def _data_parallel_group(model_chunks):
    chunk_group = getattr(model_chunks[0], "data_parallel_group", None)
    if chunk_group is not None:
        return chunk_group
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_data_parallel_group(with_context_parallel=True)
    return dist.group.WORLD if dist.is_initialized() else None


def _global_token_count(model_chunks, num_tokens):
    """Broadcast the count from the last pipeline stage (where the loss is) and sum it over data parallel."""
    group = _data_parallel_group(model_chunks)
    device = get_device_for_group(group) if group is not None else num_tokens.device
    num_tokens = num_tokens.detach().to(device=device, dtype=torch.float32).clone()
    if parallel_state.model_parallel_is_initialized() and parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(num_tokens, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(num_tokens, group=group)
    return num_tokens.item()


@torch.no_grad()
def _scale_grads(model_chunks, factor):
    for chunk in model_chunks:
        if hasattr(chunk, "scale_gradients"):
            chunk.scale_gradients(factor)
            continue
        for param in chunk.parameters():
            grad = _grad_of(param)
            if grad is not None:
                grad.mul_(factor)


def _check_chunks_sum_per_token_gradients(model_chunks):
    """Data-parallel wrappers average gradients over the data-parallel ranks unless their model config has
    `calculate_per_token_loss`; dividing such an average by the global token count would be off by that size."""
    for chunk in model_chunks:
        if isinstance(chunk, DataParallelWrapper) and not getattr(chunk.config, "calculate_per_token_loss", False):
            raise ValueError(
                "finalize_model_grads(num_tokens=...) divides the gradients by the global token count, but this "
                f"{type(chunk).__name__} was built from a model config without calculate_per_token_loss "
                "(--calculate-per-token-loss), so it averages them over the data-parallel ranks as well; set "
                "calculate_per_token_loss=True in the config the model is wrapped with, or pass num_tokens=None."
            )


def finalize_model_grads(model_chunks, num_tokens=None, pg_collection=None):
    """Complete gradient reductions across DP, TP (sequence parallel) and PP (shared embedding); see module doc.

    With `num_tokens`, a global token count of 0 (every loss token masked) leaves the gradients unscaled, as
    upstream does. Upstream's `pg_collection` is accepted as None only: the groups come from parallel_state."""
    if pg_collection is not None:
        raise ValueError(
            "finalize_model_grads(pg_collection=...) is not supported here: it reduces over parallel_state's groups "
            "(initialize_model_parallel) and the chunks' data-parallel groups; pass None"
        )
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    if num_tokens is not None:
        _check_chunks_sum_per_token_gradients(model_chunks)
    config = getattr(model_chunks[0], "config", None)
    timers = getattr(config, "timers", None)
    barrier = getattr(config, "barrier_with_L1_time", False)
    with timed(timers, "all-grads-sync", log_level=1, barrier=barrier):
        for chunk in model_chunks:
            if hasattr(chunk, "finish_grad_sync"):
                chunk.finish_grad_sync()
    if parallel_state.model_parallel_is_initialized():
        with timed(timers, "layernorm-grads-all-reduce", log_level=1, barrier=barrier):
            _allreduce_sequence_parallel_grads(model_chunks)
        with timed(timers, "embedding-grads-all-reduce", log_level=1, barrier=barrier):
            _allreduce_shared_embedding_grads(model_chunks)
    if num_tokens is not None:
        total_tokens = _global_token_count(model_chunks, torch.as_tensor(num_tokens))
        if total_tokens < 0:
            raise ValueError(
                f"finalize_model_grads: num_tokens summed over data parallel is {total_tokens}; need >= 0.")
        if total_tokens > 0:
            _scale_grads(model_chunks, 1.0 / total_tokens)

"""`finalize_model_grads`: everything that must happen to gradients between the last backward and the step.

1. finish the data-parallel reduction of every model chunk that has one (DDP, Megatron-FSDP);
2. all-reduce gradients of sequence-parallel parameters (norms) over the tensor-parallel group: each TP rank
   saw only its slice of the sequence;
3. all-reduce gradients of the embedding shared by the first and last pipeline stages over the embedding group;
4. with `num_tokens` (per-token loss), divide all gradients by the token count summed over data parallel.
Works on DDP chunks (`param.main_grad`), Megatron-FSDP chunks (anything with `finish_grad_sync`) and plain
modules (`param.grad`, reduced locally as a DTensor shard when the gradient is a DTensor).
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.device_utils import get_device_for_group


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _grad_of(param):
    main_grad = getattr(param, "main_grad", None)
    grad = main_grad if main_grad is not None else param.grad
    return None if grad is None else _local(grad)


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


def _allreduce_sequence_parallel_grads(model_chunks):
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        _all_reduce_grads(
            _params_with(model_chunks, "sequence_parallel"), parallel_state.get_tensor_model_parallel_group()
        )


def _allreduce_shared_embedding_grads(model_chunks):
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    if not parallel_state.is_rank_in_embedding_group():
        return
    group = parallel_state.get_embedding_group()
    if group is not None and dist.get_world_size(group) > 1:
        _all_reduce_grads(_params_with(model_chunks, "shared_embedding"), group)


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


def finalize_model_grads(model_chunks, num_tokens=None):
    """Complete gradient reductions across DP, TP (sequence parallel) and PP (shared embedding); see module doc."""
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    for chunk in model_chunks:
        if hasattr(chunk, "finish_grad_sync"):
            chunk.finish_grad_sync()
    if parallel_state.model_parallel_is_initialized():
        _allreduce_sequence_parallel_grads(model_chunks)
        _allreduce_shared_embedding_grads(model_chunks)
    if num_tokens is not None:
        total_tokens = _global_token_count(model_chunks, torch.as_tensor(num_tokens))
        if total_tokens <= 0:
            raise ValueError(f"finalize_model_grads: num_tokens summed over data parallel is {total_tokens}; need > 0.")
        _scale_grads(model_chunks, 1.0 / total_tokens)

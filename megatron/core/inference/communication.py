"""The one collective of generation: every tensor-parallel rank must continue with the same tokens."""

import torch
import torch.distributed as dist

from megatron.core import parallel_state


def tensor_parallel_size() -> int:
    if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return 1
    return parallel_state.get_tensor_model_parallel_world_size()


def is_tensor_parallel_source() -> bool:
    """True on the rank whose sampled tokens the tensor-parallel group uses (its TP rank 0)."""
    return tensor_parallel_size() == 1 or parallel_state.get_tensor_model_parallel_rank() == 0


def broadcast_from_tensor_parallel_source(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as TP rank 0 of this rank's group holds it (in place on the others; the same on every rank)."""
    if tensor_parallel_size() > 1:
        dist.broadcast(tensor, src=parallel_state.get_tensor_model_parallel_src_rank(),
                       group=parallel_state.get_tensor_model_parallel_group())
    return tensor

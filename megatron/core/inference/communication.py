"""The collectives of generation: every rank of the model must continue with the same tokens.

The tokens are sampled on one rank, the sampling source: tensor-parallel rank 0 of the last pipeline stage (the
stage that computes the logits). They reach the other tensor-parallel ranks of the last stage, then every
pipeline stage, in two broadcasts. What only the last stage computes (log-probabilities) is broadcast from it
over the pipeline group.
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state


def _model_parallel_initialized() -> bool:
    return dist.is_initialized() and parallel_state.model_parallel_is_initialized()


def tensor_parallel_size() -> int:
    if not _model_parallel_initialized():
        return 1
    return parallel_state.get_tensor_model_parallel_world_size()


def pipeline_parallel_size() -> int:
    if not _model_parallel_initialized():
        return 1
    return parallel_state.get_pipeline_model_parallel_world_size()


def is_pipeline_last_stage() -> bool:
    """True on the ranks that compute the logits (every rank without pipeline parallelism)."""
    return pipeline_parallel_size() == 1 or parallel_state.is_pipeline_last_stage(ignore_virtual=True)


def is_tensor_parallel_source() -> bool:
    """True on the rank whose sampled tokens the tensor-parallel group uses (its TP rank 0)."""
    return tensor_parallel_size() == 1 or parallel_state.get_tensor_model_parallel_rank() == 0


def is_sampling_source() -> bool:
    """True on the one rank of the model (TP rank 0 of the last pipeline stage) whose sampled tokens every rank
    continues with."""
    return is_pipeline_last_stage() and is_tensor_parallel_source()


def broadcast_from_tensor_parallel_source(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as TP rank 0 of this rank's group holds it (in place on the others; the same on every rank)."""
    if tensor_parallel_size() > 1:
        dist.broadcast(tensor, src=parallel_state.get_tensor_model_parallel_src_rank(),
                       group=parallel_state.get_tensor_model_parallel_group())
    return tensor


def broadcast_from_last_stage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as the last pipeline stage of this rank's pipeline holds it (in place on the other stages)."""
    if pipeline_parallel_size() > 1:
        dist.broadcast(tensor, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    return tensor


def broadcast_from_sampling_source(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as the sampling source holds it, on every rank of the model (in place on the others)."""
    if is_pipeline_last_stage():
        broadcast_from_tensor_parallel_source(tensor)
    return broadcast_from_last_stage(tensor)

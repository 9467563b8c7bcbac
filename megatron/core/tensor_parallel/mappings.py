"""Autograd-aware communication across the tensor-parallel group.

Each mapping is a pair of collectives that are each other's adjoint: what the forward does to activations,
the backward does (transposed) to gradients. Tensor-parallel mappings split/gather along the last (hidden)
dimension; sequence-parallel mappings along dimension 0, the sequence dimension of `[s, b, h]` activations.
With a tensor-parallel size of 1 every mapping is the identity.
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state

# --------------------------------------------------------------------------------------------------------
# Plain collectives (no autograd)
# --------------------------------------------------------------------------------------------------------


def _tp_group_and_size():
    size = parallel_state.get_tensor_model_parallel_world_size()
    return (parallel_state.get_tensor_model_parallel_group() if size > 1 else None), size


def _all_reduce(tensor):
    group, size = _tp_group_and_size()
    if size == 1:
        return tensor
    tensor = tensor.contiguous()
    dist.all_reduce(tensor, group=group)
    return tensor


def _all_gather_first_dim(tensor):
    group, size = _tp_group_and_size()
    if size == 1:
        return tensor
    tensor = tensor.contiguous()
    output = torch.empty((size * tensor.size(0),) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_single(output, tensor, group=group)
    return output


def _reduce_scatter_first_dim(tensor):
    group, size = _tp_group_and_size()
    if size == 1:
        return tensor
    if tensor.size(0) % size != 0:
        raise ValueError(f"sequence dimension {tensor.size(0)} is not divisible by tensor-parallel size {size}")
    tensor = tensor.contiguous()
    output = torch.empty(
        (tensor.size(0) // size,) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device
    )
    dist.reduce_scatter_tensor(output, tensor, group=group)
    return output


def _split_first_dim(tensor):
    _, size = _tp_group_and_size()
    if size == 1:
        return tensor
    if tensor.size(0) % size != 0:
        raise ValueError(f"sequence dimension {tensor.size(0)} is not divisible by tensor-parallel size {size}")
    chunk = tensor.size(0) // size
    rank = parallel_state.get_tensor_model_parallel_rank()
    return tensor[rank * chunk : (rank + 1) * chunk].contiguous()


def _split_last_dim(tensor):
    _, size = _tp_group_and_size()
    if size == 1:
        return tensor
    if tensor.size(-1) % size != 0:
        raise ValueError(f"last dimension {tensor.size(-1)} is not divisible by tensor-parallel size {size}")
    chunk = tensor.size(-1) // size
    rank = parallel_state.get_tensor_model_parallel_rank()
    return tensor[..., rank * chunk : (rank + 1) * chunk].contiguous()


def _all_gather_last_dim(tensor):
    _, size = _tp_group_and_size()
    if size == 1:
        return tensor
    # Gather along the first dimension (one contiguous buffer, rank blocks in rank order), then move that
    # dimension back to the end.
    return _all_gather_first_dim(tensor.movedim(-1, 0)).movedim(0, -1).contiguous()


# --------------------------------------------------------------------------------------------------------
# Autograd functions
# --------------------------------------------------------------------------------------------------------


class _CopyToTensorModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _all_reduce(grad_output.clone())


class _ReduceFromTensorModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _all_reduce(input_.clone())

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


class _ScatterToTensorModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _split_last_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _all_gather_last_dim(grad_output)


class _GatherFromTensorModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _all_gather_last_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_last_dim(grad_output)


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _split_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _all_gather_first_dim(grad_output)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, tensor_parallel_output_grad):
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _all_gather_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        # When the consumer is tensor-parallel each rank holds a partial gradient of the full sequence:
        # sum them and keep this rank's part. Otherwise every rank holds the full gradient already.
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_first_dim(grad_output), None
        return _split_first_dim(grad_output), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _reduce_scatter_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _all_gather_first_dim(grad_output)


# --------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------


def copy_to_tensor_model_parallel_region(input_):
    """Identity forward; all-reduce of the gradient over the tensor-parallel group (`input_` itself, with no
    autograd node and no copy of the gradient, on one tensor-parallel rank)."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return input_
    return _CopyToTensorModelParallelRegion.apply(input_)


def reduce_from_tensor_model_parallel_region(input_):
    """All-reduce forward; identity backward (`input_` itself, not a copy, on one tensor-parallel rank)."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return input_
    return _ReduceFromTensorModelParallelRegion.apply(input_)


def scatter_to_tensor_model_parallel_region(input_):
    """Keep this rank's chunk of the last dimension; all-gather the gradient."""
    return _ScatterToTensorModelParallelRegion.apply(input_)


def gather_from_tensor_model_parallel_region(input_):
    """All-gather along the last dimension; the gradient is split back."""
    return _GatherFromTensorModelParallelRegion.apply(input_)


def scatter_to_sequence_parallel_region(input_):
    """Keep this rank's chunk of the sequence (dim 0); all-gather the gradient."""
    return _ScatterToSequenceParallelRegion.apply(input_)


def gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True):
    """All-gather along the sequence (dim 0); backward reduce-scatters (or just splits, see above)."""
    return _GatherFromSequenceParallelRegion.apply(input_, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(input_):
    """Sum over the tensor-parallel group and keep this rank's sequence chunk; all-gather the gradient."""
    return _ReduceScatterToSequenceParallelRegion.apply(input_)


def all_gather_along_first_dim(tensor):
    """Non-differentiable all-gather along dim 0 over the tensor-parallel group."""
    return _all_gather_first_dim(tensor)


def all_reduce_over_tensor_model_parallel_group(tensor):
    """Non-differentiable in-place-or-returned sum over the tensor-parallel group."""
    return _all_reduce(tensor)

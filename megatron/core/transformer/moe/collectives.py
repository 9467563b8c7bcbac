"""Autograd-aware collectives of the token dispatchers, over an explicit process group along dimension 0.

Each forward collective's backward is its adjoint: gather <-> reduce-scatter (sum), all-to-all <-> the
all-to-all with the split sizes swapped. With a group of one rank every function returns its input.
"""

import torch
import torch.distributed as dist


def group_size(group):
    return 1 if group is None else dist.get_world_size(group)


def _all_gather(tensor, group):
    tensor = tensor.contiguous()
    output = tensor.new_empty((group_size(group) * tensor.size(0),) + tuple(tensor.shape[1:]))
    dist.all_gather_single(output, tensor, group=group)
    return output


def _reduce_scatter(tensor, group):
    size = group_size(group)
    if tensor.size(0) % size != 0:
        raise ValueError(f"dimension 0 ({tensor.size(0)}) is not divisible by the group size {size}")
    tensor = tensor.contiguous()
    output = tensor.new_empty((tensor.size(0) // size,) + tuple(tensor.shape[1:]))
    dist.reduce_scatter_single(output, tensor, group=group)
    return output


def _all_to_all(tensor, group, output_splits, input_splits):
    tensor = tensor.contiguous()
    output = tensor.new_empty((sum(output_splits),) + tuple(tensor.shape[1:]))
    dist.all_to_all_single(output, tensor, output_split_sizes=list(output_splits),
                           input_split_sizes=list(input_splits), group=group)
    return output


class _GatherFirstDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _all_gather(tensor, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce_scatter(grad_output, ctx.group), None


class _ReduceScatterFirstDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _reduce_scatter(tensor, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _all_gather(grad_output, ctx.group), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return _all_to_all(tensor, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad_output):
        return _all_to_all(grad_output, ctx.group, ctx.input_splits, ctx.output_splits), None, None, None


class _FinishAllToAll(torch.autograd.Function):
    """Waits for an all-to-all launched by `start_all_to_all` and returns what arrived; backward like _AllToAll."""

    @staticmethod
    def forward(ctx, tensor, launched):
        work, output, ctx.group, ctx.output_splits, ctx.input_splits = launched
        work.wait()
        return output

    @staticmethod
    def backward(ctx, grad_output):
        return _all_to_all(grad_output, ctx.group, ctx.input_splits, ctx.output_splits), None


def start_all_to_all(tensor, group, output_splits, input_splits):
    """Launch `all_to_all` without waiting; returns a callable that waits and gives its (autograd-aware) result,
    so work can run while the tokens travel."""
    if group_size(group) == 1:
        return lambda: tensor
    tensor = tensor.contiguous()
    output = tensor.new_empty((sum(output_splits),) + tuple(tensor.shape[1:]))
    work = dist.all_to_all_single(output, tensor.detach(), output_split_sizes=list(output_splits),
                                  input_split_sizes=list(input_splits), group=group, async_op=True)
    launched = (work, output, group, list(output_splits), list(input_splits))
    return lambda: _FinishAllToAll.apply(tensor, launched)


def gather_along_first_dim(tensor, group):
    """Concatenate every rank's `tensor` (same shape) in group-rank order; backward: reduce-scatter (sum)."""
    return tensor if group_size(group) == 1 else _GatherFirstDim.apply(tensor, group)


def reduce_scatter_along_first_dim(tensor, group):
    """Sum over the group, each rank keeping its block of dimension 0; backward: gather."""
    return tensor if group_size(group) == 1 else _ReduceScatterFirstDim.apply(tensor, group)


def all_to_all(tensor, group, output_splits, input_splits):
    """Rows `input_splits[r]` go to rank r; rows from rank r arrive as `output_splits[r]` (group-rank order)."""
    if group_size(group) == 1:
        return tensor
    return _AllToAll.apply(tensor, group, list(output_splits), list(input_splits))


def gather_without_grad(tensor, group):
    """`gather_along_first_dim` outside autograd; bool tensors travel as uint8 (gloo has no bool)."""
    if group_size(group) == 1:
        return tensor
    if tensor.dtype == torch.bool:
        return _all_gather(tensor.to(torch.uint8), group).to(torch.bool)
    return _all_gather(tensor.detach(), group)

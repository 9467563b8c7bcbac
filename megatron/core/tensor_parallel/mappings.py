"""Autograd-aware communication across the tensor-parallel group.

Each mapping is a pair of collectives that are each other's adjoint: what the forward does to activations,
the backward does (transposed) to gradients. Tensor-parallel mappings split/gather along the last (hidden)
dimension; sequence-parallel mappings along dimension 0, the sequence dimension of `[s, b, h]` activations.
With a tensor-parallel size of 1 every mapping is the identity. As upstream, the mappings take a `group` keyword
(default: the tensor-parallel group), and the sequence-parallel gather and reduce-scatter take per-rank row counts
(`output_split_sizes` / `input_split_sizes`) for uneven splits.
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state

# --------------------------------------------------------------------------------------------------------
# Plain collectives (no autograd)
# --------------------------------------------------------------------------------------------------------


def _tp_group_and_size(group=None):
    """(group, size): `group` when given, else the tensor-parallel group (None when it has one rank)."""
    if group is not None:
        return group, dist.get_world_size(group)
    size = parallel_state.get_tensor_model_parallel_world_size()
    return (parallel_state.get_tensor_model_parallel_group() if size > 1 else None), size


def _all_reduce(tensor, group=None):
    group, size = _tp_group_and_size(group)
    if size == 1:
        return tensor
    tensor = tensor.contiguous()
    dist.all_reduce(tensor, group=group)
    return tensor


def _check_split_sizes(what, split_sizes, size):
    if len(split_sizes) != size:
        raise ValueError(f"{what} has {len(split_sizes)} entries; pass one row count per rank of the group "
                         f"({size} ranks)")


def _all_gather_first_dim(tensor, group=None, output_split_sizes=None):
    """Concatenate every rank's `tensor` along dim 0 in rank order; `output_split_sizes[r]` rows from rank r
    (None: the same number of rows on every rank)."""
    group, size = _tp_group_and_size(group)
    if size == 1:
        return tensor
    tensor = tensor.contiguous()
    if output_split_sizes is None:
        output = torch.empty((size * tensor.size(0),) + tuple(tensor.shape[1:]), dtype=tensor.dtype,
                             device=tensor.device)
        dist.all_gather_single(output, tensor, group=group)
        return output
    rank = dist.get_rank(group)
    output_split_sizes = [int(rows) for rows in output_split_sizes]
    _check_split_sizes("output_split_sizes", output_split_sizes, size)
    if output_split_sizes[rank] != tensor.size(0):
        raise ValueError(f"output_split_sizes[{rank}] = {output_split_sizes[rank]} but this rank's input has "
                         f"{tensor.size(0)} rows along dimension 0; pass the row count of each rank's input")
    # An all-gather of unequal blocks written as an all-to-all (every rank sends its rows to every rank):
    # gloo's all_gather accepts equal sizes only.
    output = tensor.new_empty((sum(output_split_sizes),) + tuple(tensor.shape[1:]))
    dist.all_to_all_single(output, tensor.repeat((size,) + (1,) * (tensor.dim() - 1)),
                           output_split_sizes=output_split_sizes, input_split_sizes=[tensor.size(0)] * size,
                           group=group)
    return output


def _reduce_scatter_first_dim(tensor, group=None, input_split_sizes=None):
    """Sum over the group and keep this rank's rows of dim 0: an equal share, or `input_split_sizes[rank]` rows
    starting at the sum of the earlier ranks' sizes."""
    group, size = _tp_group_and_size(group)
    if size == 1:
        return tensor
    tensor = tensor.contiguous()
    if input_split_sizes is not None:
        input_split_sizes = [int(rows) for rows in input_split_sizes]
        _check_split_sizes("input_split_sizes", input_split_sizes, size)
        if sum(input_split_sizes) != tensor.size(0):
            raise ValueError(f"input_split_sizes sum to {sum(input_split_sizes)} but the input has "
                             f"{tensor.size(0)} rows along dimension 0")
        blocks = [block.contiguous() for block in torch.split(tensor, input_split_sizes, dim=0)]
        output = torch.empty_like(blocks[dist.get_rank(group)])
        dist.reduce_scatter(output, blocks, group=group)
        return output
    if tensor.size(0) % size != 0:
        raise ValueError(f"sequence dimension {tensor.size(0)} is not divisible by tensor-parallel size {size}")
    output = torch.empty(
        (tensor.size(0) // size,) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device
    )
    dist.reduce_scatter_tensor(output, tensor, group=group)
    return output


def _split_first_dim(tensor, group=None, split_sizes=None):
    group, size = _tp_group_and_size(group)
    if size == 1:
        return tensor
    rank = dist.get_rank(group)
    if split_sizes is not None:
        split_sizes = [int(rows) for rows in split_sizes]
        _check_split_sizes("output_split_sizes", split_sizes, size)
        return torch.split(tensor, split_sizes, dim=0)[rank].contiguous()
    if tensor.size(0) % size != 0:
        raise ValueError(f"sequence dimension {tensor.size(0)} is not divisible by tensor-parallel size {size}")
    chunk = tensor.size(0) // size
    return tensor[rank * chunk : (rank + 1) * chunk].contiguous()


def _split_last_dim(tensor, group=None):
    group, size = _tp_group_and_size(group)
    if size == 1:
        return tensor
    if tensor.size(-1) % size != 0:
        raise ValueError(f"last dimension {tensor.size(-1)} is not divisible by tensor-parallel size {size}")
    chunk = tensor.size(-1) // size
    rank = dist.get_rank(group)
    return tensor[..., rank * chunk : (rank + 1) * chunk].contiguous()


def _all_gather_last_dim(tensor, group=None):
    group, size = _tp_group_and_size(group)
    if size == 1:
        return tensor
    # Gather along the first dimension (one contiguous buffer, rank blocks in rank order), then move that
    # dimension back to the end.
    return _all_gather_first_dim(tensor.movedim(-1, 0), group).movedim(0, -1).contiguous()


def _reduce_scatter_last_dim(tensor, group=None):
    group, size = _tp_group_and_size(group)
    if size == 1:
        return tensor
    if tensor.size(-1) % size != 0:
        raise ValueError(f"last dimension {tensor.size(-1)} is not divisible by tensor-parallel size {size}")
    return _reduce_scatter_first_dim(tensor.movedim(-1, 0), group).movedim(0, -1).contiguous()


def _all_to_all_first_dim(tensor, group, output_split_sizes, input_split_sizes):
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    if input_split_sizes is None and tensor.size(0) % size != 0:
        raise ValueError(f"all_to_all: dimension 0 ({tensor.size(0)}) is not divisible by the group size {size}; "
                         "pass input_split_sizes and output_split_sizes_")
    tensor = tensor.contiguous()
    rows = tensor.size(0) if output_split_sizes is None else sum(output_split_sizes)
    output = tensor.new_empty((rows,) + tuple(tensor.shape[1:]))
    dist.all_to_all_single(output, tensor, output_split_sizes=output_split_sizes,
                           input_split_sizes=input_split_sizes, group=group)
    return output


# --------------------------------------------------------------------------------------------------------
# Autograd functions
# --------------------------------------------------------------------------------------------------------


class _CopyToTensorModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _all_reduce(grad_output.clone(), ctx.group), None


class _ReduceFromTensorModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        return _all_reduce(input_.clone(), group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


def _adjoint_pair(name, forward_op, backward_op):
    """An autograd function computing `forward_op(input_, group)` whose gradient is `backward_op(grad, group)`
    (the op's adjoint: a split's is the gather, a gather's the split or reduce-scatter)."""

    def forward(ctx, input_, group):
        ctx.group = group
        return forward_op(input_, group)

    def backward(ctx, grad_output):
        return backward_op(grad_output, ctx.group), None

    methods = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    return type(name, (torch.autograd.Function,), methods)


_ScatterToTensorModelParallelRegion = _adjoint_pair(
    "_ScatterToTensorModelParallelRegion", _split_last_dim, _all_gather_last_dim)
_GatherFromTensorModelParallelRegion = _adjoint_pair(
    "_GatherFromTensorModelParallelRegion", _all_gather_last_dim, _split_last_dim)
_ScatterToSequenceParallelRegion = _adjoint_pair(
    "_ScatterToSequenceParallelRegion", _split_first_dim, _all_gather_first_dim)
_AllGatherLastDimFromTensorParallelRegion = _adjoint_pair(
    "_AllGatherLastDimFromTensorParallelRegion", _all_gather_last_dim, _reduce_scatter_last_dim)
_ReduceScatterLastDimToTensorParallelRegion = _adjoint_pair(
    "_ReduceScatterLastDimToTensorParallelRegion", _reduce_scatter_last_dim, _all_gather_last_dim)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, tensor_parallel_output_grad, group, output_split_sizes):
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        ctx.group, ctx.output_split_sizes = group, output_split_sizes
        return _all_gather_first_dim(input_, group, output_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        # When the consumer is tensor-parallel each rank holds a partial gradient of the full sequence:
        # sum them and keep this rank's part. Otherwise every rank holds the full gradient already.
        if ctx.tensor_parallel_output_grad:
            grad_input = _reduce_scatter_first_dim(grad_output, ctx.group, ctx.output_split_sizes)
        else:
            grad_input = _split_first_dim(grad_output, ctx.group, ctx.output_split_sizes)
        return grad_input, None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group, input_split_sizes):
        ctx.group, ctx.input_split_sizes = group, input_split_sizes
        return _reduce_scatter_first_dim(input_, group, input_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        return _all_gather_first_dim(grad_output, ctx.group, ctx.input_split_sizes), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, input_, output_split_sizes, input_split_sizes):
        ctx.group, ctx.output_split_sizes, ctx.input_split_sizes = group, output_split_sizes, input_split_sizes
        return _all_to_all_first_dim(input_, group, output_split_sizes, input_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        # The adjoint of an all-to-all is the all-to-all with the split sizes swapped.
        grad_input = _AllToAll.apply(ctx.group, grad_output, ctx.input_split_sizes, ctx.output_split_sizes)
        return None, grad_input, None, None


# --------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------


def _group_size(group):
    return parallel_state.get_tensor_model_parallel_world_size() if group is None else dist.get_world_size(group)


def copy_to_tensor_model_parallel_region(input_, group=None):
    """Identity forward; all-reduce of the gradient over `group` (default: tensor-parallel); `input_` itself,
    with no autograd node and no copy of the gradient, on a one-rank group."""
    if _group_size(group) == 1:
        return input_
    return _CopyToTensorModelParallelRegion.apply(input_, group)


def reduce_from_tensor_model_parallel_region(input_, group=None):
    """All-reduce forward over `group` (default: tensor-parallel); identity backward (`input_` itself, not a
    copy, on a one-rank group)."""
    if _group_size(group) == 1:
        return input_
    return _ReduceFromTensorModelParallelRegion.apply(input_, group)


def scatter_to_tensor_model_parallel_region(input_, group=None):
    """Keep this rank's chunk of the last dimension; all-gather the gradient."""
    return _ScatterToTensorModelParallelRegion.apply(input_, group)


def gather_from_tensor_model_parallel_region(input_, group=None):
    """All-gather along the last dimension; the gradient is split back."""
    return _GatherFromTensorModelParallelRegion.apply(input_, group)


def scatter_to_sequence_parallel_region(input_, group=None):
    """Keep this rank's chunk of the sequence (dim 0); all-gather the gradient."""
    return _ScatterToSequenceParallelRegion.apply(input_, group)


def gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=None,
                                         output_split_sizes=None, use_global_buffer=False):
    """All-gather along the sequence (dim 0) over `group` (default: tensor-parallel), rank r contributing
    `output_split_sizes[r]` rows (None: equal shares). Backward reduce-scatters the gradient back to those rows
    or, with `tensor_parallel_output_grad=False` (every rank holds the full gradient), just splits it.
    `use_global_buffer` (upstream's reuse of one preallocated output buffer) is accepted; the result is always a
    tensor of its own."""
    return _GatherFromSequenceParallelRegion.apply(input_, tensor_parallel_output_grad, group, output_split_sizes)


def reduce_scatter_to_sequence_parallel_region(input_, group=None, input_split_sizes=None,
                                               use_global_buffer=False):
    """Sum over `group` (default: tensor-parallel) and keep this rank's rows of the sequence (dim 0): an equal
    share, or `input_split_sizes[rank]` rows; all-gather the gradient. `use_global_buffer` as above."""
    return _ReduceScatterToSequenceParallelRegion.apply(input_, group, input_split_sizes)


def all_gather_along_first_dim(tensor):
    """Non-differentiable all-gather along dim 0 over the tensor-parallel group."""
    return _all_gather_first_dim(tensor)


def all_reduce_over_tensor_model_parallel_group(tensor):
    """Non-differentiable in-place-or-returned sum over the tensor-parallel group."""
    return _all_reduce(tensor)


def all_gather_last_dim_from_tensor_parallel_region(input_, group=None):
    """All-gather along the last dimension over `group` (default: tensor-parallel); the gradient is summed over
    the group and split back (reduce-scatter), since every rank's consumer contributes to it."""
    return _AllGatherLastDimFromTensorParallelRegion.apply(input_, group)


def reduce_scatter_last_dim_to_tensor_parallel_region(input_, group=None):
    """Sum over `group` (default: tensor-parallel) and keep this rank's chunk of the last dimension; all-gather
    the gradient."""
    return _ReduceScatterLastDimToTensorParallelRegion.apply(input_, group)


def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None):
    """Rows `input_split_sizes[r]` of dimension 0 go to rank r of `group`; rows from rank r arrive as
    `output_split_sizes_[r]`, in group-rank order (None: equal splits). Backward: the reverse all-to-all."""
    if group is None:
        raise ValueError("all_to_all(group=None): pass the process group to exchange over")
    if (output_split_sizes_ is None) != (input_split_sizes is None):
        raise ValueError("all_to_all: pass both output_split_sizes_ and input_split_sizes, or neither")
    if output_split_sizes_ is not None:
        output_split_sizes_, input_split_sizes = list(output_split_sizes_), list(input_split_sizes)
    return _AllToAll.apply(group, input_, output_split_sizes_, input_split_sizes)


def _group_or_tensor_parallel(group):
    return parallel_state.get_tensor_model_parallel_group() if group is None else group


def all_to_all_sp2hp(input_, group=None):
    """Sequence-parallel to hidden-parallel: [tokens/TP, H] (leading dims flattened) -> [tokens, H/TP] over
    `group` (default: tensor-parallel), tokens in rank order."""
    group = _group_or_tensor_parallel(group)
    size = dist.get_world_size(group)
    input_ = input_.reshape(-1, input_.shape[-1])
    if input_.size(-1) % size != 0:
        raise ValueError(f"all_to_all_sp2hp: hidden size {input_.size(-1)} is not divisible by group size {size}")
    chunks = torch.split(input_, input_.size(-1) // size, dim=1)
    return all_to_all(group, torch.cat(chunks, dim=0))


def all_to_all_hp2sp(input_, group=None):
    """Hidden-parallel to sequence-parallel: [tokens, H/TP] (leading dims flattened) -> [tokens/TP, H] over
    `group` (default: tensor-parallel); the inverse of `all_to_all_sp2hp`."""
    group = _group_or_tensor_parallel(group)
    size = dist.get_world_size(group)
    input_ = input_.reshape(-1, input_.shape[-1])
    exchanged = all_to_all(group, input_)
    return torch.cat(torch.split(exchanged, exchanged.size(0) // size, dim=0), dim=-1)

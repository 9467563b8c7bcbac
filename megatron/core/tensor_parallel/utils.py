"""Partition arithmetic shared by the tensor-parallel layers: exact division, splits and vocabulary ranges."""

import torch
import torch.distributed as dist


def ensure_divisibility(numerator, denominator, what="value"):
    if denominator <= 0 or numerator % denominator != 0:
        raise ValueError(f"{what} {numerator} is not divisible by {denominator}")


def divide(numerator, denominator, what="value"):
    """`numerator / denominator` as an int; ValueError when the division is not exact."""
    ensure_divisibility(numerator, denominator, what)
    return numerator // denominator


def split_tensor_along_last_dim(tensor, num_partitions, contiguous_split_chunks=False):
    """Split `tensor` into `num_partitions` equal chunks along its last dimension."""
    chunk = divide(tensor.size(-1), num_partitions, "last dimension")
    chunks = torch.split(tensor, chunk, dim=-1)
    if contiguous_split_chunks:
        return tuple(c.contiguous() for c in chunks)
    return chunks


def split_tensor_along_dim(tensor, num_partitions, dim):
    chunk = divide(tensor.size(dim), num_partitions, f"dimension {dim}")
    return torch.split(tensor, chunk, dim=dim)


def strided_partition(full, num_partitions, rank, dim, stride=1):
    """The slice of `full` that partition `rank` holds along `dim`.

    With `stride` s the dimension is cut into num_partitions*s equal blocks and partition r holds blocks
    r, r+num_partitions, r+2*num_partitions, ... concatenated (used for fused weights such as Q/K/V or
    gate/up whose sub-matrices must each be split across ranks).
    """
    per_partition = divide(full.size(dim), num_partitions, f"size of partitioned dimension {dim}")
    block = divide(per_partition, stride, f"per-partition size along dimension {dim} (stride {stride})")
    blocks = torch.split(full, block, dim=dim)
    return torch.cat(blocks[rank::num_partitions], dim=dim)


class VocabUtility:
    """Which contiguous range [first, last) of the vocabulary a tensor-parallel rank holds."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size, rank, world_size):
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size, rank, world_size):
        per_partition = divide(global_vocab_size, world_size, "vocabulary size")
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world_size)


def _tensor_parallel_group_or(tp_group):
    from megatron.core import parallel_state

    if tp_group is not None:
        return tp_group, dist.get_world_size(tp_group), dist.get_rank(tp_group)
    size = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group() if size > 1 else None
    return group, size, parallel_state.get_tensor_model_parallel_rank()


def split_tensor_into_1d_equal_chunks(tensor, new_buffer=False, tp_group=None):
    """This rank's 1/TP of `tensor` flattened (a view, or a new tensor with `new_buffer`); no autograd."""
    _, size, rank = _tensor_parallel_group_or(tp_group)
    numel = tensor.numel()
    if numel % size != 0:
        raise ValueError(f"split_tensor_into_1d_equal_chunks: {numel} elements are not divisible by the "
                         f"tensor-parallel size {size}; pad the tensor first")
    partition = numel // size
    data = tensor.view(-1)[rank * partition : (rank + 1) * partition]
    return data.detach().clone() if new_buffer else data


def gather_split_1d_tensor(tensor, tp_group=None):
    """The inverse of `split_tensor_into_1d_equal_chunks`: every rank's chunk concatenated in rank order (a new
    1-D tensor; no autograd)."""
    group, size, _ = _tensor_parallel_group_or(tp_group)
    if size == 1:
        return tensor.detach().reshape(-1).clone()
    tensor = tensor.detach().contiguous().view(-1)
    gathered = tensor.new_empty(tensor.numel() * size)
    dist.all_gather_into_tensor(gathered, tensor, group=group)
    return gathered

"""Broadcast a batch from tensor-parallel rank 0 to the other ranks of its tensor-parallel group."""

import math

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.device_utils import get_current_device


_BAD_DTYPE, _TOO_MANY_DIMS = -1, -2  # codes rank 0 sends in place of a shape, so every rank raises


def _check_dtype(key, tensor, datatype):
    if tensor.dtype != datatype:
        raise ValueError(f"broadcast_data: {key} has dtype {tensor.dtype}, expected {datatype}; convert it or pass "
                         "its dtype as datatype")


def broadcast_data(keys, data, datatype):
    """Return {key: tensor} with rank 0's `data[key]` (all of dtype `datatype`) on every tensor-parallel rank.

    Shapes are broadcast first, so only tensor-parallel rank 0 needs `data`; other ranks may pass None.
    Tensors must have between 1 and 8 dimensions, all non-empty. A tensor of another dtype or with more
    dimensions raises ValueError on every rank of the group (not only on rank 0, which would leave the others
    waiting).
    """
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        for key in keys:
            _check_dtype(key, data[key], datatype)
        return {key: data[key].to(get_current_device()) for key in keys}
    group = parallel_state.get_tensor_model_parallel_group()
    src = parallel_state.get_tensor_model_parallel_src_rank()
    device = get_current_device()
    is_src = parallel_state.get_tensor_model_parallel_rank() == 0
    max_dims = 8
    sizes = torch.zeros(len(keys), max_dims, dtype=torch.long, device=device)
    if is_src:
        for index, key in enumerate(keys):
            if data[key].dtype != datatype:
                sizes[index, 0] = _BAD_DTYPE
            elif data[key].dim() > max_dims:
                sizes[index, 0] = _TOO_MANY_DIMS
            else:
                sizes[index, : data[key].dim()] = torch.tensor(data[key].shape, dtype=torch.long)
    dist.broadcast(sizes, src, group=group)
    for index, key in enumerate(keys):
        code = int(sizes[index, 0])
        if code == _BAD_DTYPE:
            if is_src:
                _check_dtype(key, data[key], datatype)
            raise ValueError(f"broadcast_data: {key} on tensor-parallel rank 0 does not have dtype {datatype}")
        if code == _TOO_MANY_DIMS:
            raise ValueError(f"broadcast_data: {key} has more than {max_dims} dimensions; reshape it")
    shapes = [[int(s) for s in row if s > 0] for row in sizes.tolist()]
    numels = [math.prod(shape) for shape in shapes]
    if is_src:
        flat = torch.cat([data[key].contiguous().view(-1).to(device) for key in keys])
    else:
        flat = torch.empty(sum(numels), dtype=datatype, device=device)
    dist.broadcast(flat, src, group=group)
    output, offset = {}, 0
    for key, shape, numel in zip(keys, shapes, numels):
        output[key] = flat[offset : offset + numel].view(shape)
        offset += numel
    return output

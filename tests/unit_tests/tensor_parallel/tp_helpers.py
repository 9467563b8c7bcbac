"""Shared helpers for tensor-parallel tests run on the rank pool."""

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.model_parallel_config import ModelParallelConfig

ATOL = 1e-5
RTOL = 1e-5


def setup_tensor_parallel(sequence_parallel=False, **config_kwargs):
    """Tensor parallelism over the whole pool; returns (config, tp_rank, tp_size)."""
    tp_size = dist.get_world_size()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    config = ModelParallelConfig(
        tensor_model_parallel_size=tp_size, sequence_parallel=sequence_parallel, **config_kwargs
    )
    return config, ps.get_tensor_model_parallel_rank(), tp_size


def shared_randn(*shape, seed):
    """The same tensor on every rank (an explicit generator leaves the default one alone)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def chunk(tensor, dim, rank, parts):
    size = tensor.size(dim) // parts
    return tensor.narrow(dim, rank * size, size)


def gather_partitions(tensor, dim):
    """Concatenate every tensor-parallel rank's `tensor` along `dim` (the full tensor from its partitions)."""
    parts = [torch.empty_like(tensor) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, tensor.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


def assert_close(actual, expected, what):
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")

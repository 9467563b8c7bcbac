"""Upstream's `DistributedDataParallelConfig` fields: each works as upstream's, or is refused naming it."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.model_parallel_config import ModelParallelConfig
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.optimizer.toy_models import build_toy_model


def test_use_custom_fsdp_is_the_former_name_of_use_megatron_fsdp():
    config = DistributedDataParallelConfig(use_custom_fsdp=True, data_parallel_sharding_strategy="optim_grads")
    assert config.use_megatron_fsdp and config.wrapper_name == "megatron_fsdp"
    assert dataclasses.replace(config, bucket_size=8).use_megatron_fsdp


def test_suggested_communication_unit_size_sets_the_megatron_fsdp_bucket_size():
    config = DistributedDataParallelConfig(use_megatron_fsdp=True, suggested_communication_unit_size=4096)
    assert config.bucket_size == 4096
    assert dataclasses.replace(config, overlap_grad_reduce=True).bucket_size == 4096
    with pytest.raises(ValueError, match=r"suggested_communication_unit_size .*needs use_megatron_fsdp=True"):
        DistributedDataParallelConfig(suggested_communication_unit_size=4096)
    with pytest.raises(ValueError, match=r"suggested_communication_unit_size sets Megatron-FSDP's bucket_size"):
        DistributedDataParallelConfig(use_megatron_fsdp=True, suggested_communication_unit_size=4096, bucket_size=10)
    with pytest.raises(ValueError, match=r"suggested_communication_unit_size=0 must be positive"):
        DistributedDataParallelConfig(use_megatron_fsdp=True, suggested_communication_unit_size=0)


def test_reduce_scatter_with_fp32_accumulation_needs_megatron_ddp_distributed_optimizer():
    config = DistributedDataParallelConfig(use_distributed_optimizer=True, reduce_scatter_with_fp32_accumulation=True)
    assert config.reduce_scatter_with_fp32_accumulation
    for others in (dict(), dict(use_megatron_fsdp=True)):
        with pytest.raises(ValueError, match=r"reduce_scatter_with_fp32_accumulation .*needs "
                                             r"use_distributed_optimizer=True"):
            DistributedDataParallelConfig(reduce_scatter_with_fp32_accumulation=True, **others)


def _bf16_gradients_reduced_with_fp32_accumulation():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_toy_model(dtype=torch.bfloat16)
    ddp = DistributedDataParallel(ModelParallelConfig(), DistributedDataParallelConfig(
        use_distributed_optimizer=True, reduce_scatter_with_fp32_accumulation=True, bucket_size=100), model)
    local_grads = [torch.randn(world_size, *param.shape, generator=torch.Generator().manual_seed(index)).bfloat16()
                   for index, param in enumerate(model.parameters())]
    ddp.zero_grad_buffer()
    for param, grads in zip(model.parameters(), local_grads, strict=True):
        param.main_grad.copy_(grads[rank])
    ddp.finish_grad_sync()
    mismatches = 0
    for param, grads in zip(model.parameters(), local_grads, strict=True):
        # Each rank's gradient is scaled by 1/DP in bf16, then the DP contributions are summed in fp32 and the sum
        # is rounded to bf16 once.
        expected = (grads * (1.0 / world_size)).float().sum(dim=0).bfloat16()
        buffer = ddp.buffers[0]
        owned = buffer.local_shard_ranges(param)
        if owned is not None:
            begin, end, _ = owned
            mismatches += int((param.main_grad.view(-1)[begin:end] != expected.view(-1)[begin:end]).sum())
    return mismatches, len(ddp.buffers[0].buckets)


@pytest.mark.parametrize("world_size", [3])
def test_reduce_scatter_with_fp32_accumulation_rounds_the_fp32_sum_once(world_size):
    for mismatches, num_buckets in run_on_ranks(world_size, _bf16_gradients_reduced_with_fp32_accumulation):
        assert num_buckets > 1 and mismatches == 0


def test_gradient_checks_a_wrapper_does_not_run_are_refused_by_name():
    assert DistributedDataParallelConfig(use_megatron_fsdp=True, check_for_nan_in_grad=True).check_for_nan_in_grad
    refused = (
        (dict(use_megatron_fsdp=True, check_for_large_grads=True), "check_for_large_grads: the megatron_fsdp"),
        (dict(use_torch_fsdp2=True, check_for_large_grads=True), "check_for_large_grads: the torch_fsdp2"),
        (dict(use_torch_fsdp2=True, check_for_nan_in_grad=True), "check_for_nan_in_grad: the torch_fsdp2"),
    )
    for fields, prefix in refused:
        with pytest.raises(ValueError, match=rf"{prefix} wrapper does not check its gradients per bucket; drop it"):
            DistributedDataParallelConfig(**fields)

"""Buffer layout: bucket sizes and padding, the shared embedding's own bucket, and shards that tile each bucket."""

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.model_parallel_config import ModelParallelConfig
from tests.unit_tests.multiprocess_harness import run_on_ranks


def _model_with_shared_embedding():
    model = torch.nn.Module()
    model.embedding = torch.nn.Parameter(torch.randn(7, 3))  # 21 elements
    model.embedding.shared_embedding = True
    model.first = torch.nn.Linear(3, 5)  # 15 + 5
    model.second = torch.nn.Linear(5, 2)  # 10 + 2
    return model


def _layout(use_distributed_optimizer, bucket_size):
    world_size = dist.get_world_size()
    model = _model_with_shared_embedding()
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer,
                                               bucket_size=bucket_size)
    ddp = DistributedDataParallel(ModelParallelConfig(), ddp_config, model)
    (buffer,) = ddp.buffers
    bounds = [(bucket.offset, bucket.offset + bucket.numel) for bucket in buffer.buckets]
    # Buckets are contiguous, padded to the DP size, and cover the buffer.
    assert bounds[0][0] == 0 and bounds[-1][1] == buffer.numel
    assert all(end == next_start for (_, end), (next_start, _) in zip(bounds, bounds[1:]))
    assert all((end - start) % world_size == 0 for start, end in bounds)
    names = {id(param): name for name, param in model.named_parameters()}
    bucket_names = [[names[id(p)] for p in bucket.params] for bucket in buffer.buckets]
    # Every element of every parameter is owned by exactly one rank.
    owned = torch.zeros(buffer.numel)
    for param in buffer.params:
        ranges = buffer.local_shard_ranges(param)
        if ranges is not None:
            param_start, param_end, buffer_start = ranges
            owned[buffer_start:buffer_start + param_end - param_start] += 1
    dist.all_reduce(owned)
    for param in buffer.params:
        start, end, _ = buffer.param_index_map[param]
        assert torch.equal(owned[start:end], torch.ones(end - start))
        assert param.main_grad.data_ptr() == buffer.grad_data[start:end].data_ptr()
    return bucket_names


@pytest.mark.parametrize("world_size", [3])
def test_bucket_layout_and_sharding(world_size):
    # Reverse parameter order; a new bucket once 12 elements are reached.
    (names,) = set(map(str, run_on_ranks(world_size, _layout, False, 12)))
    assert names == str([["second.bias", "second.weight"], ["first.bias", "first.weight"], ["embedding"]])
    # With the distributed optimizer the shared embedding always gets a bucket of its own.
    (names,) = set(map(str, run_on_ranks(world_size, _layout, True, None)))
    assert names == str([["second.bias", "second.weight", "first.bias", "first.weight"], ["embedding"]])
    (names,) = set(map(str, run_on_ranks(world_size, _layout, False, None)))
    assert names == str([["second.bias", "second.weight", "first.bias", "first.weight", "embedding"]])


def _padded_layouts_and_memory():
    """Bucket lengths with --ddp-pad-buckets-for-high-nccl-busbw (distributed optimizer or not), against the
    bucket contents, and what the memory line reports for the wrapper against its buffers and a frozen
    parameter."""
    from megatron.core.distributed.data_parallel_base import tensor_bytes
    from megatron.training.training_log import memory_usage
    from tests.unit_tests.optimizer.toy_models import build_toy_model

    results = {}
    for use_distributed_optimizer in (True, False):
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer,
                                                   bucket_size=40, pad_buckets_for_high_nccl_busbw=True)
        ddp = DistributedDataParallel(ModelParallelConfig(), ddp_config, build_toy_model())
        (buffer,) = ddp.buffers
        results[use_distributed_optimizer] = [
            (bucket.numel, sum(param.numel() for param in bucket.params)) for bucket in buffer.buckets]

    model = build_toy_model()
    model[0].weight.requires_grad_(False)  # frozen by the model provider: in no buffer
    ddp = DistributedDataParallel(ModelParallelConfig(),
                                  DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=40), model)
    (buffer,) = ddp.buffers
    line = memory_usage([ddp], None, torch.device("cpu"))
    frozen_bytes = tensor_bytes(model[0].weight)
    results["memory"] = dict(params=line["params_bytes"], grads=line["grads_bytes"], frozen=frozen_bytes,
                             buffer_numel=buffer.numel,
                             trainable_numel=sum(p.numel() for p in model.parameters() if p.requires_grad))
    return results


@pytest.mark.parametrize("world_size", [3])
def test_busbw_padding_and_memory_line_of_padded_buffers(world_size):
    for result in run_on_ranks(world_size, _padded_layouts_and_memory):
        # Upstream's divisor with the distributed optimizer: lcm(DP, 128, 2**16) = 196608 at DP3, each bucket
        # padded up to the next multiple of it.
        divisor = 3 * 2**16
        for numel, content in result[True]:
            assert numel == -(-content // divisor) * divisor
        # Without the distributed optimizer nothing is sharded: the flag does not pad (beyond DP).
        for numel, content in result[False]:
            assert numel == -(-content // world_size) * world_size
        memory = result["memory"]
        # The padded flat buffers are what the rank holds (fp32: 4 bytes per element), the frozen weight aside.
        assert memory["buffer_numel"] > memory["trainable_numel"]
        assert memory["grads"] == 4 * memory["buffer_numel"]
        assert memory["params"] == 4 * memory["buffer_numel"] + memory["frozen"]

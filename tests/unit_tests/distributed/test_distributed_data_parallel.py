"""DDP gradients equal single-process full-batch gradients, for every bucketing/overlap mode and DP size."""

import copy

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.model_parallel_config import ModelParallelConfig
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.optimizer.toy_models import build_toy_model, mse_loss, toy_batch

MICRO_BATCH_SIZE = 2
NUM_MICROBATCHES = 4

MODES = {
    "sync_one_bucket": dict(ddp=dict(), disable_bucketing=False),
    "sync_small_buckets": dict(ddp=dict(bucket_size=40), disable_bucketing=False),
    "overlap_small_buckets": dict(ddp=dict(overlap_grad_reduce=True, bucket_size=40), disable_bucketing=False),
    "overlap_bucketing_disabled": dict(ddp=dict(overlap_grad_reduce=True, bucket_size=40), disable_bucketing=True),
    "overlap_average_in_collective": dict(
        ddp=dict(overlap_grad_reduce=True, bucket_size=64, average_in_collective=True), disable_bucketing=False
    ),
    "overlap_distributed_optimizer_layout": dict(
        ddp=dict(overlap_grad_reduce=True, bucket_size=40, use_distributed_optimizer=True), disable_bucketing=False
    ),
}


def _rank_microbatch(inputs, targets, microbatch, rank, world_size):
    start = (microbatch * world_size + rank) * MICRO_BATCH_SIZE
    return inputs[start:start + MICRO_BATCH_SIZE], targets[start:start + MICRO_BATCH_SIZE]


def _ddp_gradients_match_full_batch(mode_name):
    mode = MODES[mode_name]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_toy_model()
    reference = copy.deepcopy(model)
    ddp_config = DistributedDataParallelConfig(**mode["ddp"])
    ddp = DistributedDataParallel(ModelParallelConfig(), ddp_config, model,
                                  disable_bucketing=mode["disable_bucketing"])

    buckets = [bucket for buffer in ddp.buffers for bucket in buffer.buckets]
    assert all(bucket.numel % world_size == 0 for bucket in buckets)
    if mode["disable_bucketing"] or "bucket_size" not in mode["ddp"]:
        assert len(buckets) == 1
    else:
        assert len(buckets) > 1
    for param in model.parameters():
        assert param.main_grad.shape == param.shape

    for iteration in range(2):  # the second iteration checks that zero_grad_buffer resets all state
        ddp.zero_grad_buffer()
        reference.zero_grad()
        inputs, targets = toy_batch(iteration, MICRO_BATCH_SIZE * NUM_MICROBATCHES * world_size)
        mse_loss(reference, inputs, targets).backward()
        for microbatch in range(NUM_MICROBATCHES):
            local_inputs, local_targets = _rank_microbatch(inputs, targets, microbatch, rank, world_size)
            is_last = microbatch == NUM_MICROBATCHES - 1
            if is_last:
                (mse_loss(ddp, local_inputs, local_targets) / NUM_MICROBATCHES).backward()
            else:
                with ddp.no_sync():
                    (mse_loss(ddp, local_inputs, local_targets) / NUM_MICROBATCHES).backward()
        ddp.finish_grad_sync()
        for name, param in model.named_parameters():
            assert param.grad is None, name
            torch.testing.assert_close(param.main_grad, dict(reference.named_parameters())[name].grad,
                                       atol=1e-6, rtol=1e-5, msg=lambda m: f"{name} iteration {iteration}: {m}")
    return True


@pytest.mark.parametrize("mode_name", list(MODES))
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ddp_gradients_match_single_process(world_size, mode_name):
    assert all(run_on_ranks(world_size, _ddp_gradients_match_full_batch, mode_name))


def _overlap_starts_buckets_during_backward():
    model = build_toy_model()
    ddp = DistributedDataParallel(ModelParallelConfig(), DistributedDataParallelConfig(overlap_grad_reduce=True,
                                                                                       bucket_size=40), model)
    ddp.zero_grad_buffer()
    inputs, targets = toy_batch(0, 4)
    mse_loss(ddp, inputs, targets).backward()
    started_after_backward = [bucket.grad_sync_started for bucket in ddp.buffers[0].buckets]
    ddp.finish_grad_sync()
    ddp.zero_grad_buffer()
    with ddp.no_sync():
        mse_loss(ddp, inputs, targets).backward()
    started_in_no_sync = [bucket.grad_sync_started for bucket in ddp.buffers[0].buckets]
    ddp.finish_grad_sync()
    return started_after_backward, started_in_no_sync


@pytest.mark.parametrize("world_size", [2])
def test_overlap_starts_every_bucket_in_backward_but_not_in_no_sync(world_size):
    for started_after_backward, started_in_no_sync in run_on_ranks(world_size, _overlap_starts_buckets_during_backward):
        assert len(started_after_backward) > 1 and all(started_after_backward)
        assert not any(started_in_no_sync)


def _broadcast_and_scale():
    rank = dist.get_rank()
    model = build_toy_model(seed=rank)  # different weights on every rank
    ddp = DistributedDataParallel(ModelParallelConfig(), DistributedDataParallelConfig(use_distributed_optimizer=True),
                                  model)
    ddp.broadcast_params()
    expected = build_toy_model(seed=0)
    for param, reference in zip(model.parameters(), expected.parameters(), strict=True):
        assert torch.equal(param, reference)
        # With the distributed optimizer each parameter is a view of the flat parameter buffer.
        assert param.data_ptr() >= ddp.buffers[0].param_data.data_ptr()
    ddp.zero_grad_buffer()
    mse_loss(ddp, *toy_batch(rank, 4)).backward()
    before = [param.main_grad.clone() for param in model.parameters()]
    ddp.scale_gradients(0.25)
    for param, old in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(param.main_grad, 0.25 * old)
    ddp.finish_grad_sync()
    return True


@pytest.mark.parametrize("world_size", [3])
def test_broadcast_params_and_scale_gradients(world_size):
    assert all(run_on_ranks(world_size, _broadcast_and_scale))


def _nan_check_raises():
    model = build_toy_model()
    ddp = DistributedDataParallel(ModelParallelConfig(), DistributedDataParallelConfig(check_for_nan_in_grad=True),
                                  model)
    ddp.zero_grad_buffer()
    mse_loss(ddp, *toy_batch(0, 4)).backward()
    model[0].weight.main_grad[0, 0] = float("nan")
    try:
        ddp.finish_grad_sync()
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.parametrize("world_size", [1])
def test_nan_check_names_the_bucket(world_size):
    (message,) = run_on_ranks(world_size, _nan_check_raises)
    assert message is not None and "nan" in message and "bucket 0" in message


def test_config_validation():
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        DistributedDataParallelConfig(overlap_grad_reduce=True, overlap_param_gather=True)
    with pytest.raises(ValueError, match="overlap_grad_reduce"):
        DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_param_gather=True)
    with pytest.raises(ValueError, match="bucket_size"):
        DistributedDataParallelConfig(bucket_size=0)


def _late_gradient_raises():
    model = build_toy_model()
    ddp = DistributedDataParallel(ModelParallelConfig(), DistributedDataParallelConfig(overlap_grad_reduce=True), model)
    ddp.zero_grad_buffer()
    mse_loss(ddp, *toy_batch(0, 4)).backward()  # starts the reduction of the only bucket
    try:
        mse_loss(ddp, *toy_batch(1, 4)).backward()
    except RuntimeError as error:
        message = str(error)
    else:
        message = None
    ddp.finish_grad_sync()
    return message


@pytest.mark.parametrize("world_size", [2])
def test_gradient_after_reduction_started_raises(world_size):
    for message in run_on_ranks(world_size, _late_gradient_raises):
        assert message is not None and "no_sync" in message

"""DDP gradients equal single-process full-batch gradients, for every bucketing/overlap mode and DP size."""

import copy
import logging
import types

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


def _bad_gradient_in_a_late_parameter_is_named(**check):
    model = build_toy_model()
    ddp = DistributedDataParallel(ModelParallelConfig(), DistributedDataParallelConfig(**check), model)
    ddp.zero_grad_buffer()
    mse_loss(ddp, *toy_batch(0, 4)).backward()
    model[0].weight.main_grad[1, 2] = float("inf")
    try:  # 0.weight is the last parameter of the (reversed) bucket
        ddp.finish_grad_sync()
    except RuntimeError as error:
        return str(error)
    return None


class _CapturedWarnings(logging.Handler):
    """The messages logged by the gradient buffers and the rerun state machine while it is installed."""

    LOGGERS = ("megatron.core.distributed.param_and_grad_buffer", "megatron.core.rerun_state_machine")

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)
        return self.messages

    def __exit__(self, *unused):
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)


# Iteration 1 is skipped, the next 100 bucket norms (<= 1) are the reference, then 9.9 passes and 10 does not.
LARGE_GRAD_NORMS = [1e3] + [1.0 - 0.001 * step for step in range(100)] + [9.9, 10.0]
LARGE_GRADS_MESSAGE = ("found unexpectedly large grads in bucket #0 in backward pass before data-parallel "
                       "communication collective")


def _ddp_with_large_grad_check():
    model = build_toy_model()
    ddp = DistributedDataParallel(ModelParallelConfig(), DistributedDataParallelConfig(check_for_large_grads=True),
                                  model)

    def step(norm):
        ddp.zero_grad_buffer()
        model[0].weight.main_grad[1, 2] = norm  # the bucket's only non-zero gradient
        ddp.finish_grad_sync()

    return step


def _large_grads_through_the_rerun_state_machine():
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine, initialize_rerun_state_machine

    machine = initialize_rerun_state_machine(mode="validate_results")
    try:
        step = _ddp_with_large_grad_check()
        passes = []
        with _CapturedWarnings() as warnings:
            for norm in LARGE_GRAD_NORMS:
                runs = 0
                while machine.should_run_forward_backward(None):
                    runs += 1
                    step(norm)
                passes.append(runs)
        verdict = machine.should_checkpoint_and_exit()
        return passes, verdict, machine.failed_call.message, warnings
    finally:
        destroy_rerun_state_machine()


@pytest.mark.parametrize("world_size", [1])
def test_large_grad_check_compares_with_the_first_bucket_norms_as_upstream(world_size):
    ((passes, verdict, message, warnings),) = run_on_ranks(world_size, _large_grads_through_the_rerun_state_machine)
    assert passes == [1] * 102 + [2]  # only the 10x norm is rejected, and its step reruns in place
    assert verdict == (True, True, 16)  # reproduced: save and resume elsewhere to tell a fault from a correct result
    assert message == LARGE_GRADS_MESSAGE
    bucket_warnings = [warning for warning in warnings if warning.startswith("bucket 0")]
    (warning,) = bucket_warnings  # logged by the rejecting check, not by the rerun's comparison
    assert warning.startswith("bucket 0: local grad norm 1.000e+01; largest gradients in: 0.weight, "), warning


def _large_grads_in_a_loop_of_ones_own():
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine, initialize_rerun_state_machine

    initialize_rerun_state_machine()  # what get_rerun_state_machine() makes implicitly: mode disabled
    try:
        step = _ddp_with_large_grad_check()
        with _CapturedWarnings() as warnings:
            for norm in LARGE_GRAD_NORMS[1:]:  # no machine loop counts iterations: every norm counts
                step(norm)
        return warnings
    finally:
        destroy_rerun_state_machine()


@pytest.mark.parametrize("world_size", [1])
def test_large_grad_check_in_a_plain_training_loop_warns_without_stopping(world_size):
    (warnings,) = run_on_ranks(world_size, _large_grads_in_a_loop_of_ones_own)
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("bucket 0: local grad norm 1.000e+01; largest gradients in: 0.weight, ")
    assert warnings[1] == f"rank 0, iteration 0: unexpected result 10.0 ({LARGE_GRADS_MESSAGE})"


@pytest.mark.parametrize("world_size", [1])
def test_nan_check_names_the_parameter_with_the_non_finite_gradient(world_size):
    (message,) = run_on_ranks(world_size, _bad_gradient_in_a_late_parameter_is_named, check_for_nan_in_grad=True)
    expected = "Rank 0: found Inf in local grad norm (inf) of bucket 0 "
    assert message is not None and message.startswith(expected), message
    assert message.endswith("non-finite gradients in: 0.weight."), message


def _unfrozen_after_wrapping():
    model = build_toy_model()
    model[3].weight.requires_grad_(False)
    ddp = DistributedDataParallel(ModelParallelConfig(), DistributedDataParallelConfig(), model)
    assert not hasattr(model[3].weight, "main_grad")
    model[3].weight.requires_grad_(True)
    ddp.zero_grad_buffer()
    mse_loss(ddp, *toy_batch(dist.get_rank(), 4)).backward()
    try:
        ddp.finish_grad_sync()
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.parametrize("world_size", [2])
def test_a_parameter_unfrozen_after_wrapping_is_refused_not_left_unreduced(world_size):
    for message in run_on_ranks(world_size, _unfrozen_after_wrapping):
        assert message is not None and "3.weight" in message and "requires_grad=False when the model was wrapped" in (
            message)


def _pg_collection_groups_are_used():
    rank = dist.get_rank()
    singleton_groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    results = {}
    for name, group in (("world", dist.group.WORLD), ("own rank", singleton_groups[rank])):
        model = build_toy_model()
        reference = copy.deepcopy(model)
        collection = types.SimpleNamespace(dp_cp=group)
        ddp = DistributedDataParallel(ModelParallelConfig(), DistributedDataParallelConfig(), model, False, collection)
        ddp.zero_grad_buffer()
        mse_loss(ddp, *toy_batch(rank, 4)).backward()
        ddp.finish_grad_sync()
        mse_loss(reference, *toy_batch(rank, 4)).backward()
        if name == "world":
            for param in reference.parameters():
                dist.all_reduce(param.grad)
                param.grad /= dist.get_world_size()
        for param, expected in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(param.main_grad, expected.grad, atol=1e-6, rtol=1e-5)
        results[name] = ddp.data_parallel_group is group
    return results


@pytest.mark.parametrize("world_size", [2])
def test_upstream_pg_collection_chooses_the_data_parallel_group(world_size):
    for result in run_on_ranks(world_size, _pg_collection_groups_are_used):
        assert result == {"world": True, "own rank": True}


def test_pg_collection_without_the_needed_group_names_it():
    model = build_toy_model()
    with pytest.raises(ValueError, match=r"needs pg_collection\.dp_cp"):
        DistributedDataParallel(ModelParallelConfig(), DistributedDataParallelConfig(), model,
                                pg_collection=types.SimpleNamespace())
    hybrid = DistributedDataParallelConfig(use_distributed_optimizer=True, num_distributed_optimizer_instances=2)
    with pytest.raises(ValueError, match=r"num_distributed_optimizer_instances > 1 needs pg_collection\.intra_dp_cp"):
        DistributedDataParallel(ModelParallelConfig(), hybrid, model, pg_collection=types.SimpleNamespace(dp_cp=1))


def test_config_takes_upstream_fields_and_assignment_names_replace():
    import dataclasses

    config = DistributedDataParallelConfig(gradient_reduce_div_fusion=False)
    assert not config.gradient_reduce_div_fusion and DistributedDataParallelConfig().gradient_reduce_div_fusion
    assert not config.reuse_grad_buf_for_mxfp8_param_ag and not config.delay_wgrad_compute
    with pytest.raises(ValueError, match=r"reuse_grad_buf_for_mxfp8_param_ag .*MXFP8 .*drop it"):
        DistributedDataParallelConfig(reuse_grad_buf_for_mxfp8_param_ag=True)
    with pytest.raises(ValueError, match=r"delay_wgrad_compute \(--delay-wgrad-compute\) needs Transformer Engine"):
        DistributedDataParallelConfig(delay_wgrad_compute=True)
    with pytest.raises(dataclasses.FrozenInstanceError,
                       match=r"is frozen .*dataclasses.replace\(ddp_config, bucket_size="):
        config.bucket_size = 1000  # upstream's training loop assigns it in place
    assert config.bucket_size is None and dataclasses.replace(config, bucket_size=1000).bucket_size == 1000


class _BranchyModel(torch.nn.Module):
    """`first` -> (`branch` on some ranks only) -> `head`, with a frozen `frozen` scale."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.branch, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
        self.frozen = torch.nn.Parameter(torch.full((4,), 0.5), requires_grad=False)

    def forward(self, inputs, use_branch):
        hidden = self.first(inputs) * self.frozen
        return self.head(self.branch(hidden) if use_branch else hidden).square().mean()


def _unused_and_frozen_parameters():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _BranchyModel()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(ModelParallelConfig(),
                                  DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=5), model)
    for iteration in range(2):
        ddp.zero_grad_buffer()
        reference.zero_grad()
        ddp(toy_batch(rank + iteration, 3)[0][:, :4], rank == 0).backward()  # `branch` unused on rank 1
        ddp.finish_grad_sync()
        for other in range(world_size):
            (reference(toy_batch(other + iteration, 3)[0][:, :4], other == 0) / world_size).backward()
        assert not hasattr(model.frozen, "main_grad") and model.frozen.grad is None
        for name, param in model.named_parameters():
            if param.requires_grad:  # the unused gradient counts as zeros in the average, as upstream
                torch.testing.assert_close(param.main_grad, dict(reference.named_parameters())[name].grad)
    return len(ddp._buckets)


@pytest.mark.parametrize("world_size", [2])
def test_unused_and_frozen_parameters_under_overlap(world_size):
    assert all(num_buckets > 1 for num_buckets in run_on_ranks(world_size, _unused_and_frozen_parameters))


def _forward_pre_hooks_disabled_and_enabled():
    rank = dist.get_rank()
    model = build_toy_model()
    initial = [param.detach().clone() for param in model.parameters()]
    ddp = DistributedDataParallel(ModelParallelConfig(), DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=40), model)
    buckets = [bucket for buffer in ddp.buffers for bucket in buffer.buckets]

    def step_on_local_shards(amount):  # what the distributed optimizer's step does: update the owned shard only
        with torch.no_grad():
            for bucket in buckets:
                start, end = bucket.local_shard_range()
                bucket.param_data[start:end] += amount * (rank + 1)

    def gathered_values(amount):  # every element updated by its owner, rank r adding amount * (r + 1)
        values = []
        for param, start_value in zip(model.parameters(), initial, strict=True):
            buffer = next(buffer for buffer in ddp.buffers if param in buffer.param_index_map)
            begin, end, bucket_id = buffer.param_index_map[param]
            bucket = buffer.buckets[bucket_id]
            owners = (torch.arange(begin, end) - bucket.offset) // bucket.shard_size()
            values.append(start_value + (amount * (owners + 1)).view(param.shape).to(param.dtype))
        return values

    step_on_local_shards(1.0)
    ddp.start_param_sync()  # asynchronous under overlap_param_gather
    ddp.disable_forward_pre_hook()  # as upstream's loop does before evaluation: the weights are gathered now
    for param, expected in zip(model.parameters(), gathered_values(1.0), strict=True):
        torch.testing.assert_close(param.detach(), expected)
    step_on_local_shards(2.0)
    ddp.start_param_sync(model.parameters(), force_dispatch=False)  # as upstream's param_sync_func is called
    assert any(bucket.param_sync_pending() for bucket in buckets)  # still asynchronous
    ddp.enable_forward_pre_hook()
    ddp(toy_batch(0, 2)[0])  # each module waits for its bucket's gather before it runs
    pending = [bucket.param_sync_pending() for bucket in buckets]
    for param, expected in zip(model.parameters(), gathered_values(3.0), strict=True):
        torch.testing.assert_close(param.detach(), expected)
    messages = []
    without_overlap = DistributedDataParallel(ModelParallelConfig(), DistributedDataParallelConfig(
        use_distributed_optimizer=True), build_toy_model())
    for call in (ddp.enable_forward_pre_hook, without_overlap.disable_forward_pre_hook):
        try:
            call()
        except RuntimeError as error:
            messages.append(str(error))
    return len(buckets), pending, messages


@pytest.mark.parametrize("world_size", [2])
def test_upstream_forward_pre_hook_switches(world_size):
    for num_buckets, pending, (twice, without_overlap) in run_on_ranks(world_size,
                                                                       _forward_pre_hooks_disabled_and_enabled):
        assert num_buckets > 1 and not any(pending)
        assert "already installed; call disable_forward_pre_hook() first" in twice
        assert "disable_forward_pre_hook(): " in without_overlap and "(--overlap-param-gather)" in without_overlap


def _steps_with_torch_zero_grad():
    rank = dist.get_rank()
    model = build_toy_model()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(ModelParallelConfig(), DistributedDataParallelConfig(overlap_grad_reduce=True), model)
    for step in range(2):
        ddp.zero_grad()  # torch's habit instead of zero_grad_buffer(): each step's gradients start from zero
        reference.zero_grad()
        mse_loss(ddp, *toy_batch(10 * step + rank, 4)).backward()
        ddp.finish_grad_sync()
        for other in range(dist.get_world_size()):
            (mse_loss(reference, *toy_batch(10 * step + other, 4)) / dist.get_world_size()).backward()
        for param, expected in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(param.main_grad, expected.grad, atol=1e-6, rtol=1e-5)
    return True


@pytest.mark.parametrize("world_size", [2])
def test_torch_zero_grad_clears_the_gradient_buffers(world_size):
    assert all(run_on_ranks(world_size, _steps_with_torch_zero_grad))

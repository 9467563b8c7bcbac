"""The distributed optimizer (ZeRO-1 over DP) reproduces single-process AdamW, and its checkpoints round-trip."""

import copy

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.optimizer import DistributedOptimizer, OptimizerConfig, get_megatron_optimizer
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.optimizer.toy_models import build_toy_model, mse_loss, reference_param_groups, toy_batch

LR, WEIGHT_DECAY, CLIP_GRAD, SAMPLES_PER_RANK = 0.01, 0.1, 0.05, 2


def _build(overlap, seed=0, num_distributed_optimizer_instances=1):
    model = build_toy_model(seed=seed)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=overlap,
                                               overlap_param_gather=overlap, bucket_size=40,
                                               num_distributed_optimizer_instances=num_distributed_optimizer_instances)
    ddp = DistributedDataParallel(ModelParallelConfig(), ddp_config, model)
    config = OptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=CLIP_GRAD, use_distributed_optimizer=True,
                             log_num_zeros_in_grad=True)
    optimizer = get_megatron_optimizer(config, [ddp])
    assert isinstance(optimizer, DistributedOptimizer)
    return model, ddp, optimizer


def _train_step(ddp, optimizer, step):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    inputs, targets = toy_batch(step, SAMPLES_PER_RANK * world_size)
    local = slice(rank * SAMPLES_PER_RANK, (rank + 1) * SAMPLES_PER_RANK)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    mse_loss(ddp, inputs[local], targets[local]).backward()
    finalize_model_grads([ddp])
    return optimizer.step()


def _reference_step(reference, reference_optimizer, step):
    inputs, targets = toy_batch(step, SAMPLES_PER_RANK * dist.get_world_size())
    reference_optimizer.zero_grad()
    mse_loss(reference, inputs, targets).backward()
    num_zeros = sum(int((param.grad == 0).sum()) for param in reference.parameters())
    grad_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP_GRAD).item()
    reference_optimizer.step()
    return grad_norm, num_zeros


def _assert_params_equal(model, reference):
    for (name, param), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, expected, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def _matches_adamw(overlap, num_distributed_optimizer_instances=1):
    if num_distributed_optimizer_instances > 1:
        parallel_state.initialize_model_parallel(num_distributed_optimizer_instances=num_distributed_optimizer_instances)
    model, ddp, optimizer = _build(overlap, num_distributed_optimizer_instances=num_distributed_optimizer_instances)
    shard_group_size = dist.get_world_size(ddp.groups.shard_group)
    assert shard_group_size == dist.get_world_size() // num_distributed_optimizer_instances
    reference = copy.deepcopy(build_toy_model())
    reference_optimizer = torch.optim.AdamW(reference_param_groups(reference, WEIGHT_DECAY, LR))

    owned = torch.tensor([sum(p.numel() for p in optimizer.main_params())])
    dist.all_reduce(owned)
    # Shards partition the model exactly, once per optimizer instance.
    assert owned.item() == num_distributed_optimizer_instances * sum(p.numel() for p in model.parameters())
    for step in range(3):
        update_successful, grad_norm, num_zeros = _train_step(ddp, optimizer, step)
        expected_norm, expected_zeros = _reference_step(reference, reference_optimizer, step)
        assert update_successful
        assert grad_norm == pytest.approx(expected_norm, rel=1e-5)
        assert grad_norm > CLIP_GRAD  # clipping is exercised
        assert num_zeros == expected_zeros
    buckets = [bucket for buffer in ddp.buffers for bucket in buffer.buckets]
    if overlap:  # the all-gathers are still in flight; the next forward's pre-hooks complete them
        assert len(buckets) > 1 and all(bucket.param_sync_pending() for bucket in buckets)
        ddp(toy_batch(9, 2)[0])
    assert not any(bucket.param_sync_pending() for bucket in buckets)
    _assert_params_equal(model, reference)
    return True


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_optimizer_matches_single_process_adamw(world_size, overlap):
    assert all(run_on_ranks(world_size, _matches_adamw, overlap))


@pytest.mark.parametrize("world_size", [4])
def test_hybrid_sharding_two_optimizer_instances_matches_adamw(world_size):
    assert all(run_on_ranks(world_size, _matches_adamw, True, 2))


def _state_dict_round_trips():
    model, ddp, optimizer = _build(overlap=False)
    for step in range(2):
        _train_step(ddp, optimizer, step)
    saved_model = copy.deepcopy(ddp.state_dict())
    saved_optimizer = copy.deepcopy(optimizer.state_dict())

    restored_model, restored_ddp, restored_optimizer = _build(overlap=False, seed=7)
    restored_ddp.load_state_dict(saved_model)
    restored_optimizer.load_state_dict(saved_optimizer)
    _train_step(ddp, optimizer, 2)
    _train_step(restored_ddp, restored_optimizer, 2)
    for param, expected in zip(restored_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(param, expected)
    return True


@pytest.mark.parametrize("world_size", [2])
def test_sharded_state_dict_round_trip_on_same_dp_size(world_size):
    assert all(run_on_ranks(world_size, _state_dict_round_trips))


def _gathered_state_is_dp_independent():
    """Gathered state equals the single-process AdamW state, and a state built from it loads at this DP size."""
    model, ddp, optimizer = _build(overlap=False)
    reference = copy.deepcopy(build_toy_model())
    groups = reference_param_groups(reference, WEIGHT_DECAY, LR)
    reference_optimizer = torch.optim.AdamW(groups)
    for step in range(3):
        _train_step(ddp, optimizer, step)
        _reference_step(reference, reference_optimizer, step)

    gathered = optimizer.gathered_state_dict()
    reference_params = groups[0]["params"] + groups[1]["params"]
    assert gathered["step"] == 3.0
    for state, param in zip(gathered["param_states"], reference_params, strict=True):
        torch.testing.assert_close(state["main_param"], param.detach(), atol=1e-6, rtol=1e-5)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[key], reference_optimizer.state[param][key], atol=1e-7, rtol=1e-5)

    # A checkpoint that knows nothing of sharding (built from the reference) loads into fresh sharded optimizers.
    unsharded = {
        "param_states": [
            {"main_param": p.detach().clone(), **{k: reference_optimizer.state[p][k].clone()
                                                  for k in ("exp_avg", "exp_avg_sq")}}
            for p in reference_params
        ],
        "step": 3.0,
        "param_groups": gathered["param_groups"],
        "grad_scaler": None,
    }
    restored_model, restored_ddp, restored_optimizer = _build(overlap=False, seed=3)
    restored_optimizer.load_gathered_state_dict(unsharded)
    _assert_params_equal(restored_model, reference)
    _train_step(restored_ddp, restored_optimizer, 3)
    _reference_step(reference, reference_optimizer, 3)
    _assert_params_equal(restored_model, reference)
    # Weights loaded without optimizer state: the shards must follow them before the next step.
    restored_model.load_state_dict(model.state_dict())
    restored_optimizer.reload_model_params()
    for shard in restored_optimizer._shards:
        expected = shard.model_param.detach().reshape(-1)[shard.param_start:shard.param_end]
        assert torch.equal(shard.main_param.detach(), expected)
    with pytest.raises(ValueError, match="sharded differently"):
        restored_optimizer.load_state_dict({**optimizer.state_dict(), "shard_layout": [(0, 0, 1)]})
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_gathered_state_dict_moves_across_dp_sizes(world_size):
    assert all(run_on_ranks(world_size, _gathered_state_is_dp_independent))


def _fp16_overflow_in_one_shard_skips_everywhere():
    rank = dist.get_rank()
    model = build_toy_model(dtype=torch.float16)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    ddp = DistributedDataParallel(ModelParallelConfig(), ddp_config, model)
    config = OptimizerConfig(lr=LR, fp16=True, initial_loss_scale=64.0, hysteresis=1, use_distributed_optimizer=True)
    optimizer = get_megatron_optimizer(config, [ddp])
    assert all(p.dtype == torch.float32 for p in optimizer.main_params())
    assert all(p.main_grad.dtype == torch.float32 for p in model.parameters())
    before = [param.detach().clone() for param in model.parameters()]
    ddp.zero_grad_buffer()
    inputs, targets = toy_batch(rank, 4, dtype=torch.float16)
    optimizer.scale_loss(mse_loss(ddp, inputs, targets)).backward()
    finalize_model_grads([ddp])
    if rank == 0:  # an element only rank 0's shard covers: the others must learn of it through found_inf
        ddp.buffers[0].grad_data[0] = float("inf")
    update_successful, grad_norm, _ = optimizer.step()
    unchanged = all(torch.equal(param, old) for param, old in zip(model.parameters(), before))
    return update_successful, grad_norm, optimizer.get_loss_scale().item(), unchanged


@pytest.mark.parametrize("world_size", [2])
def test_fp16_overflow_on_one_rank_skips_the_step_on_all(world_size):
    for update_successful, grad_norm, loss_scale, unchanged in run_on_ranks(
        world_size, _fp16_overflow_in_one_shard_skips_everywhere
    ):
        assert not update_successful and grad_norm is None
        assert loss_scale == 32.0 and unchanged


def _main_param_storage_and_state_bytes(dtype):
    """Where each main parameter's values live, and the memory line's optimizer-state bytes against the bytes of
    the state tensors the optimizer holds, after two steps of a `dtype` model."""
    from megatron.core.distributed.data_parallel_base import tensor_bytes
    from megatron.training.training_log import memory_usage

    half = dtype != torch.float32
    model = build_toy_model(dtype=dtype)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=40,
                                               grad_reduce_in_fp32=half)
    ddp = DistributedDataParallel(ModelParallelConfig(), ddp_config, model)
    config = OptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=CLIP_GRAD, use_distributed_optimizer=True,
                             bf16=dtype == torch.bfloat16)
    optimizer = get_megatron_optimizer(config, [ddp])
    for step in range(2):
        inputs, targets = toy_batch(step + 10 * dist.get_rank(), SAMPLES_PER_RANK, dtype=dtype)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        mse_loss(ddp, inputs, targets).backward()
        finalize_model_grads([ddp])
        assert optimizer.step()[0]

    buffer_storages = {buffer.param_data.untyped_storage().data_ptr() for buffer in ddp.buffers}
    in_buffer = [param.untyped_storage().data_ptr() in buffer_storages for param in optimizer.main_params()]
    # The model weights hold the values the optimizer stepped (in the model's dtype).
    follow = all(torch.equal(shard.model_param.detach().reshape(-1)[shard.param_start:shard.param_end],
                             shard.main_param.detach().to(dtype)) for shard in optimizer._shards)
    state_tensors = [value for state in optimizer.optimizer.state.values() for value in state.values()
                     if torch.is_tensor(value)]
    moments = [state[key] for state in optimizer.optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")]
    owned = sum(param.numel() for param in optimizer.main_params())
    reported = memory_usage([ddp], optimizer, torch.device("cpu"))["optimizer_state_bytes"]
    return {"in_buffer": in_buffer, "follow": follow, "owned": owned, "reported": reported,
            "state_bytes": sum(tensor_bytes(value) for value in state_tensors),
            "moment_bytes": sum(tensor_bytes(value) for value in moments)}


@pytest.mark.parametrize("world_size", [2])
def test_fp32_shards_are_stepped_in_the_parameter_buffer(world_size):
    """fp32: the optimizer steps each shard where DDP's parameter buffer holds it (no main copy), so the memory
    line's optimizer state is the Adam state alone; bf16 keeps fp32 main copies outside the buffer."""
    fp32 = run_on_ranks(world_size, _main_param_storage_and_state_bytes, torch.float32)
    assert sum(result["owned"] for result in fp32) == sum(p.numel() for p in build_toy_model().parameters())
    for result in fp32:
        assert result["in_buffer"] and all(result["in_buffer"]) and result["follow"]
        assert result["moment_bytes"] == 2 * 4 * result["owned"]  # two fp32 moments per owned element
        assert result["reported"] == result["state_bytes"]
    for result in run_on_ranks(world_size, _main_param_storage_and_state_bytes, torch.bfloat16):
        assert result["in_buffer"] and not any(result["in_buffer"]) and result["follow"]
        assert result["reported"] == result["state_bytes"] + 4 * result["owned"]  # plus the fp32 main copies

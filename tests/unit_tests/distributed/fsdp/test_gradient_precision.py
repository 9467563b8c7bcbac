"""Gradient precision and the configuration fields that steer it and the data-parallel topology.

A bf16 model with fp32 main weights reduces and accumulates its gradients in fp32 by default (the 1/DP pre-scale
computed in fp32 too): the reduced gradients equal the exact (float64) average of every rank's and microbatch's
bf16 gradients to fp32 precision, which bf16 reduction or accumulation misses by orders of magnitude.
`grad_reduce_in_fp32`, `num_distributed_optimizer_instances` and `hybrid_fsdp_group` are honoured or rejected
with a message naming the flag."""

import copy

import pytest
import torch

from megatron_fsdp.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.resharding import shard_of_unsharded
from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

MICROBATCHES = 2


def test_policy_defaults_to_fp32_reduction_with_fp32_main_weights():
    policy = MixedPrecisionPolicy()
    assert policy.grads_dtype_for(torch.bfloat16) == torch.float32
    assert policy.comm_dtype_for(torch.bfloat16) == torch.float32
    assert policy.comm_dtype_for(torch.float16) == torch.float32
    # main weights in the model dtype: gradients stay in it unless asked otherwise
    assert MixedPrecisionPolicy(main_params_dtype=torch.bfloat16).grads_dtype_for(torch.bfloat16) == torch.bfloat16
    explicit = MixedPrecisionPolicy(main_grads_dtype=torch.bfloat16)
    assert explicit.comm_dtype_for(torch.bfloat16) == torch.bfloat16
    # grad_reduce_in_fp32: fp32 reduction even when accumulation is asked for in bf16
    forced = explicit.with_grad_reduce_in_fp32(True)
    assert forced.comm_dtype_for(torch.bfloat16) == torch.float32
    assert forced.grads_dtype_for(torch.bfloat16) == torch.bfloat16
    assert explicit.with_grad_reduce_in_fp32(False) is explicit
    with pytest.raises(ValueError, match="grad_reduce_in_fp32=True contradicts MixedPrecisionPolicy.grad_comm_dtype"):
        MixedPrecisionPolicy(grad_comm_dtype=torch.bfloat16).with_grad_reduce_in_fp32(True)


def _expected_flat_grads(plain, batches, world):
    """float64 average over ranks of each rank's bf16 gradients summed over its microbatches, per parameter name."""
    total = {name: torch.zeros(p.shape, dtype=torch.float64) for name, p in plain.named_parameters()
             if p.requires_grad}
    for rank in range(world):
        inputs, target = (models.local_slice(t, rank, world) for t in batches)
        chunk = inputs.shape[0] // MICROBATCHES
        for micro in range(MICROBATCHES):
            part = slice(micro * chunk, (micro + 1) * chunk)
            plain.zero_grad()
            (models.loss_fn(plain(inputs[part]), target[part]) / MICROBATCHES).backward()
            for name, param in plain.named_parameters():
                if param.grad is not None:
                    total[name] += param.grad.double()
    return {name: value / world for name, value in total.items()}


def _reduced_bf16_gradients():
    import torch.distributed as dist

    import megatron_fsdp

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = models.make_batches(1, dtype=torch.bfloat16)[0]
    results = {}
    for strategy in range(4):
        module = models.make_model(0, torch.bfloat16)
        expected = _expected_flat_grads(copy.deepcopy(module), batches, world)
        model = megatron_fsdp.fully_shard_model(module, fsdp_unit_modules=[models.Block], zero_dp_strategy=strategy)
        inputs, target = (models.local_slice(t, rank, world) for t in batches)
        chunk = inputs.shape[0] // MICROBATCHES
        for micro in range(MICROBATCHES):
            part = slice(micro * chunk, (micro + 1) * chunk)
            context = model.no_sync() if micro < MICROBATCHES - 1 else models._null()
            with context:
                (models.loss_fn(model(inputs[part]), target[part]) / MICROBATCHES).backward()
        model.finish_grad_sync()
        worst, bf16_rounding, dtypes = 0.0, 0.0, set()
        for group in model.groups:
            if group.main_grads is None:
                continue
            dtypes.add((group.grad_dtype, group.comm_dtype, group.main_grads.dtype))
            flat = torch.zeros(group.layout.padded_numel, dtype=torch.float64)
            for name, span in zip(group.names, group.layout.spans):
                flat[span.flat_start:span.flat_end] = expected[name].reshape(-1)
            if strategy != 0:  # this rank's shard: its rows of every parameter
                shard = torch.zeros(group.layout.shard_numel, dtype=torch.float64)
                shard_of_unsharded(group.layout, flat, group.dp_rank, shard)
                flat = shard
            scale = flat.abs().max().item() or 1.0
            worst = max(worst, (group.main_grads.double() - flat).abs().max().item() / scale)
            bf16_rounding = max(bf16_rounding, (flat.bfloat16().double() - flat).abs().max().item() / scale)
        results[strategy] = (worst, bf16_rounding, dtypes)
    return results


@pytest.mark.parametrize("world_size", [3])
def test_bf16_model_reduces_and_accumulates_in_fp32(world_size):
    for results in run_on_ranks(world_size, _reduced_bf16_gradients):
        for strategy, (worst, bf16_rounding, dtypes) in results.items():
            assert dtypes == {(torch.float32, torch.float32, torch.float32)}, (strategy, dtypes)
            # fp32 sums of 6 bf16 values (exact in fp32 up to the 1/3 scale's rounding): ~1e-7 relative error
            assert worst < 1e-6, (strategy, worst)
            # and the check can tell: merely rounding the exact result to bf16 is off by > 100x that
            assert bf16_rounding > 1e-4, (strategy, bf16_rounding)


def _config_fields():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import megatron_fsdp
    from megatron_fsdp import DistributedDataParallelConfig, MegatronFSDP

    errors = {}

    def capture(key, build):
        try:
            build()
        except ValueError as error:
            errors[key] = str(error)

    bf16_config = DistributedDataParallelConfig(data_parallel_sharding_strategy=3, grad_reduce_in_fp32=True)
    model = MegatronFSDP(models.make_model(0, torch.bfloat16), bf16_config, fsdp_unit_modules=[models.Block],
                         mixed_precision_policy=MixedPrecisionPolicy(main_grads_dtype=torch.bfloat16))
    dtypes = {(group.grad_dtype, group.comm_dtype) for group in model.groups if group.trainable}
    capture("comm_conflict", lambda: MegatronFSDP(
        models.make_model(0, torch.bfloat16), bf16_config,
        mixed_precision_policy=MixedPrecisionPolicy(grad_comm_dtype=torch.bfloat16)))
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("outer", "shard"))
    lonely = dist.new_group([0])  # every rank creates it; it holds rank 0 only
    hybrid = dict(device_mesh=mesh, dp_shard_dim="shard", dp_outer_dim="outer")
    megatron_fsdp.fully_shard_model(models.make_model(), hybrid_fsdp_group=dist.group.WORLD, **hybrid)  # valid
    capture("hybrid_wrong", lambda: megatron_fsdp.fully_shard_model(models.make_model(), hybrid_fsdp_group=lonely,
                                                                    **hybrid))
    capture("hybrid_without_outer", lambda: megatron_fsdp.fully_shard_model(
        models.make_model(), hybrid_fsdp_group=dist.group.WORLD))
    capture("instances", lambda: MegatronFSDP(models.make_model(), DistributedDataParallelConfig(
        data_parallel_sharding_strategy=3, num_distributed_optimizer_instances=2)))
    return dtypes, errors


@pytest.mark.parametrize("world_size", [2])
def test_config_fields_are_honoured_or_rejected(world_size):
    for dtypes, errors in run_on_ranks(world_size, _config_fields):
        assert dtypes == {(torch.bfloat16, torch.float32)}  # bf16 accumulation, fp32 reduction
        assert "grad_reduce_in_fp32=True contradicts" in errors["comm_conflict"]
        assert "hybrid_fsdp_group holds ranks [0]" in errors["hybrid_wrong"]
        assert "hybrid_fsdp_group" in errors["hybrid_without_outer"] and "dp_outer_dim" in errors[
            "hybrid_without_outer"]
        assert "num_distributed_optimizer_instances=2 needs a dp_outer_dim" in errors["instances"]

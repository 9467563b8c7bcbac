"""Parameter and gradient offload (`param_offload`): ZeRO-3 with its shard buffers in host memory trains the
same numbers as without; the buffers come from the offload placement, a shard travels to the device before
every gather, and the placement pins only for an accelerator. Real device memory: a `gpu` test."""

import pytest
import torch

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS = 3


@pytest.mark.parametrize("device, can_pin, pinned", [("cuda", True, True), ("cuda", False, False),
                                                     ("cpu", True, False)])
def test_placement_pins_only_for_an_accelerator(device, can_pin, pinned):
    from megatron_fsdp.offload import ShardOffload

    offload = ShardOffload.for_device(device, can_pin=can_pin)
    assert offload.pin_memory == pinned and offload.host_device == torch.device("cpu")
    buffer = ShardOffload.for_device("cpu").zeros(5, torch.bfloat16)
    assert buffer.dtype == torch.bfloat16 and buffer.device.type == "cpu" and not buffer.any()


def test_offload_needs_zero3():
    import megatron_fsdp

    with pytest.raises(ValueError, match="param_offload=True .* needs data_parallel_sharding_strategy="
                                         "'optim_grads_params'"):
        megatron_fsdp.DistributedDataParallelConfig(data_parallel_sharding_strategy="optim", param_offload=True)


def _train(param_offload, record):
    import megatron_fsdp
    from megatron_fsdp.offload import ShardOffload

    from megatron_fsdp.weight_buffers import GroupWeights

    calls = {"zeros": [], "to_compute_device": 0, "gathers": 0}
    originals = ShardOffload.zeros, ShardOffload.to_compute_device
    original_start_gather = GroupWeights.start_gather

    def start_gather(self, *args, **kwargs):
        calls["gathers"] += 1
        return original_start_gather(self, *args, **kwargs)

    def zeros(self, numel, dtype):
        calls["zeros"].append(numel)
        return originals[0](self, numel, dtype)

    def to_compute_device(self, tensor):
        calls["to_compute_device"] += 1
        return originals[1](self, tensor)

    if record:
        ShardOffload.zeros, ShardOffload.to_compute_device = zeros, to_compute_device
    GroupWeights.start_gather = start_gather
    try:
        module = models.make_model()
        model, optimizer = megatron_fsdp.fully_shard(module, models.make_optimizer(module.parameters()),
                                                     fsdp_unit_modules=[models.Block], param_offload=param_offload)
        losses = models.train_sharded(model, optimizer, NUM_STEPS)
    finally:
        ShardOffload.zeros, ShardOffload.to_compute_device = originals
        GroupWeights.start_gather = original_start_gather
    groups = [group for group in model.groups if group.trainable]
    layout = {
        "offloaded": [group.offload is not None for group in model.groups],
        # Main weights and main gradients of every trainable group (the compute shard is the main weights).
        "shard_buffers": sorted(numel for group in groups for numel in (group.main_weights.numel(),
                                                                        group.main_grads.numel())),
        "frozen_shards": sorted(group.compute_shard.numel() for group in model.groups if not group.trainable),
        "keeps_main_grads": all(not group.releases_main_grads for group in groups),
        "groups": len(model.groups),
    }
    return losses, models.full_params(model), calls, layout


def _offload_and_plain():
    return {offload: _train(offload, record=offload) for offload in (False, True)}


@pytest.mark.parametrize("world_size", [2])
def test_offloaded_zero3_trains_like_zero3(world_size):
    for result in run_on_ranks(world_size, _offload_and_plain):
        (losses, params, plain_calls, plain_layout), (offloaded_losses, offloaded_params, calls, layout) = (
            result[False], result[True])
        assert losses[-1] < losses[0]
        assert offloaded_losses == pytest.approx(losses, rel=1e-6, abs=0)
        for name, value in params.items():
            torch.testing.assert_close(offloaded_params[name], value, rtol=1e-6, atol=0, msg=name)
        assert not any(plain_layout["offloaded"]) and all(layout["offloaded"])
        # Every shard buffer (trainable and frozen groups) came from the offload placement.
        assert sorted(calls["zeros"]) == sorted(layout["shard_buffers"] + layout["frozen_shards"])
        assert layout["keeps_main_grads"]  # host gradient shards are kept, not released between steps
        # The same schedule of gathers, and a shard goes to the device for each gather, at its start (only then).
        assert calls["gathers"] == plain_calls["gathers"] > NUM_STEPS * layout["groups"]
        assert calls["to_compute_device"] == calls["gathers"]


@pytest.mark.gpu
def test_offloaded_shards_and_optimizer_state_rest_in_pinned_host_memory(tmp_path):
    import torch.distributed as dist

    import megatron_fsdp

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        module = models.make_model().cuda()
        model, optimizer = megatron_fsdp.fully_shard(module, models.make_optimizer(module.parameters()),
                                                     fsdp_unit_modules=[models.Block], param_offload=True)
        losses = []
        for inputs, target in models.make_batches(3):
            optimizer.zero_grad()
            loss = models.loss_fn(model(inputs.cuda()), target.cuda())
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        torch.cuda.synchronize()
        assert losses[-1] < losses[0]
        for group in model.groups:
            assert group.compute_shard.device.type == "cpu" and group.compute_shard.is_pinned()
            if group.trainable:
                assert group.main_grads.device.type == "cpu" and group.main_grads.is_pinned()
        moments = [value for state in optimizer.state.values() for value in state.values()
                   if torch.is_tensor(value) and value.dim() > 0]
        assert moments and all(value.device.type == "cpu" for value in moments)
    finally:
        dist.destroy_process_group()

"""A module without parameters wrapped with Megatron-FSDP (an empty pipeline stage: it passes its input on) in
front of a wrapped model that has them. Under every sharding strategy, and under HSDP / HFSDP: the pair trains
to the same losses as the model alone, the gradient of the input passes back through the empty wrapper
unchanged (bit for bit: it does no arithmetic), and the empty wrapper's part of every step (gradient sync, the
weight install after the optimizer step, the parameter sync, zeroing, clipping) issues no gradient or weight
collective, holds no bytes and has an empty state dict that loads back.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS = 2


class PassThrough(nn.Module):
    def forward(self, x):
        return x


def _mesh_kwargs(hybrid):
    """A 1-D mesh over the world, or (hybrid) 2 replicas x 2 shard ranks with an outer dim as in test_fully_shard."""
    if hybrid is None:
        return {}
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    mesh[("dp_outer", "dp_shard")]._flatten("hsdp")
    return dict(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                hybrid_fsdp_group=mesh["hsdp"].get_group(), outer_dp_sharding_strategy=hybrid)


def _train(strategy, hybrid, with_empty_module):
    """Global mean losses and this rank's input gradients of each step, and (with the empty wrapper) what it
    reported: its clipped norm, bytes held, collective calls and state dict."""
    from megatron_fsdp import clip_grad_norm_, fully_shard, fully_shard_model

    kwargs = dict(zero_dp_strategy=strategy, **_mesh_kwargs(hybrid))
    module = models.make_model(0)
    optimizer = models.make_optimizer([p for p in module.parameters() if p.requires_grad])
    model, optimizer = fully_shard(module, optimizer, fsdp_unit_modules=[models.Block], **kwargs)
    empty = fully_shard_model(PassThrough(), **kwargs) if with_empty_module else None
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, input_grads, norms = [], [], []
    for inputs, target in models.make_batches(NUM_STEPS):
        inputs, target = (models.local_slice(t, rank, world) for t in (inputs, target))
        inputs.requires_grad_(True)
        optimizer.zero_grad()
        hidden = empty(inputs) if empty is not None else inputs
        loss = models.loss_fn(model(hidden), target)
        loss.backward()
        if empty is not None:  # what the training loop does with every model chunk
            empty.finish_grad_sync()
            norms.append(float(clip_grad_norm_(empty, 1.0)))
        optimizer.step()
        if empty is not None:
            empty.install_optimized_model_weights()
            empty.start_param_sync()
            empty.zero_grad_buffer()
        losses.append(models.global_mean(loss.item()))
        input_grads.append(inputs.grad.clone())
    if empty is None:
        return losses, input_grads, None
    state = empty.state_dict()
    empty.load_state_dict(state)
    report = (norms, empty.memory_report()["total_persistent"], sum(empty.counter.calls.values()), state)
    return losses, input_grads, report


def _with_and_without(strategies, hybrid):
    return {strategy: (_train(strategy, hybrid, True), _train(strategy, hybrid, False)) for strategy in strategies}


CASES = [
    (2, ["no_shard", "optim", "optim_grads", "optim_grads_params"], None),
    (4, ["optim_grads_params"], "no_shard"),  # HSDP
    (4, ["optim_grads_params"], "optim"),  # HFSDP
]


@pytest.mark.parametrize("world_size, strategies, hybrid", CASES)
def test_parameterless_module_passes_through_and_stays_silent(world_size, strategies, hybrid):
    reference, _ = models.reference_losses(NUM_STEPS)
    for per_strategy in run_on_ranks(world_size, _with_and_without, strategies, hybrid):
        for strategy, (with_empty, alone) in per_strategy.items():
            losses, input_grads, (norms, held_bytes, collective_calls, state) = with_empty
            assert losses == alone[0], strategy
            assert losses == pytest.approx(reference[:NUM_STEPS], abs=1e-5), strategy
            for grad, expected in zip(input_grads, alone[1]):
                assert torch.equal(grad, expected) and grad.abs().sum() > 0, strategy
            assert norms == [0.0] * NUM_STEPS and held_bytes == 0 and collective_calls == 0, strategy
            assert state == {}, strategy

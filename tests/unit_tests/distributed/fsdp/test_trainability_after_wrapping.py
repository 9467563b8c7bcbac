"""`requires_grad_()` after wrapping: which parameters train is fixed when the model is wrapped, so a forward after
freezing or unfreezing a parameter raises an error naming it, and the way the error suggests to stop training a
parameter mid-run (a param group of its own at lr 0) trains like freezing it in a plain torch loop."""

import pytest

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS = 3
STRATEGIES = (0, 1, 2, 3)


def _wrap(module, optimizer, strategy):
    import megatron_fsdp

    return megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[models.Block], zero_dp_strategy=strategy)


def _error_of_forward_after(change, strategy):
    """The error message of the first forward after `change(module)`, made after one training step."""
    module = models.make_model(0)
    model, optimizer = _wrap(module, models.make_optimizer([p for p in module.parameters() if p.requires_grad]),
                             strategy)
    models.train_sharded(model, optimizer, 1)
    change(model.module)
    inputs, _ = models.make_batches(1)[0]
    try:
        model(inputs[:2])
    except ValueError as error:
        return str(error)
    return None


def _freeze_block(module):
    module.blocks[1].requires_grad_(False)


def _unfreeze_frozen_layer(module):
    module.frozen.requires_grad_(True)


@pytest.mark.parametrize("world_size", [2])
def test_freezing_or_unfreezing_after_wrapping_raises_naming_the_parameter(world_size):
    for strategy in STRATEGIES:
        for message in run_on_ranks(world_size, _error_of_forward_after, _freeze_block, strategy):
            assert message is not None, strategy
            assert "'blocks.1.fc1.weight' was frozen" in message, (strategy, message)
            assert "before fully_shard" in message and "'lr'" in message, (strategy, message)
        for message in run_on_ranks(world_size, _error_of_forward_after, _unfreeze_frozen_layer, strategy):
            assert message is not None, strategy
            assert "'frozen.weight' was unfrozen" in message, (strategy, message)
            assert "add_param_group" in message, (strategy, message)


def _blocks_1_group(named):
    """Two param groups: blocks.1's trainable parameters, and every other trainable one."""
    own = [p for name, p in named if p.requires_grad and name.startswith("blocks.1.")]
    rest = [p for name, p in named if p.requires_grad and not name.startswith("blocks.1.")]
    return [{"params": rest}, {"params": own}]


def _reference_losses_freezing_after_first_step():
    """Plain torch: blocks.1 frozen with requires_grad_(False) after the first step."""
    model = models.make_model(0)
    optimizer = models.make_optimizer(_blocks_1_group(list(model.named_parameters())))
    losses = []
    for step, (inputs, target) in enumerate(models.make_batches(NUM_STEPS + 1)):
        if step == 1:
            model.blocks[1].requires_grad_(False)
        loss = models.loss_fn(model(inputs), target)
        losses.append(loss.item())
        if step == NUM_STEPS:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return losses


def _losses_with_lr_zero_after_first_step(strategy):
    module = models.make_model(0)
    optimizer = models.make_optimizer(_blocks_1_group(list(module.named_parameters())))
    model, optimizer = _wrap(module, optimizer, strategy)
    losses = models.train_sharded(model, optimizer, 1)[:-1]
    optimizer.param_groups[1]["lr"] = 0.0
    return losses + models.train_from_step(model, optimizer, NUM_STEPS - 1, 1)


@pytest.mark.parametrize("world_size", [2])
def test_lr_zero_group_stops_training_like_freezing_in_torch(world_size):
    reference = _reference_losses_freezing_after_first_step()
    for strategy in (1, 3):
        for losses in run_on_ranks(world_size, _losses_with_lr_zero_after_first_step, strategy):
            assert losses == pytest.approx(reference, rel=1e-6, abs=1e-6), strategy

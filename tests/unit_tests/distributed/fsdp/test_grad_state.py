"""The gradient state machines a parameter group owns (grad_state.py): the transitions allowed, the states a real
step walks through under each strategy, and a schedule mistake caught instead of reducing stale data."""

import pytest

from megatron_fsdp.grad_state import GradState, GradStateError, OuterGradState, checked_transition
from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

ALLOWED = {
    (GradState.EMPTY, GradState.ACCUMULATING), (GradState.ACCUMULATING, GradState.ACCUMULATING),
    (GradState.ACCUMULATING, GradState.REDUCED), (GradState.REDUCED, GradState.ACCUMULATING),
    (OuterGradState.NONE, OuterGradState.DUE), (OuterGradState.DUE, OuterGradState.DUE),
    (OuterGradState.DUE, OuterGradState.REDUCED), (OuterGradState.REDUCED, OuterGradState.NONE),
}


@pytest.mark.parametrize("machine", [GradState, OuterGradState])
def test_only_listed_transitions_are_allowed(machine):
    for current in machine:
        for new in machine:
            if (current, new) in ALLOWED:
                assert checked_transition(current, new, "blocks.0.fc1.weight") is new
            else:
                with pytest.raises(GradStateError) as error:
                    checked_transition(current, new, "blocks.0.fc1.weight")
                message = str(error.value)
                assert "'blocks.0.fc1.weight'" in message
                assert f"{machine.__name__}.{current.name}" in message and f"{machine.__name__}.{new.name}" in message


def test_a_state_of_the_other_machine_is_refused():
    with pytest.raises(GradStateError):
        checked_transition(GradState.EMPTY, OuterGradState.DUE, "w")


def _states_through_a_step(strategy):
    import megatron_fsdp

    module = models.make_model(0)
    optimizer = models.make_optimizer([p for p in module.parameters() if p.requires_grad])
    model, optimizer = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[models.Block],
                                                 zero_dp_strategy=strategy)
    trainable = [group for group in model.groups if group.trainable]
    frozen = [group for group in model.groups if not group.trainable]

    def states():
        return sorted({group.grad_state.name for group in trainable})

    inputs, target = models.make_batches(1)[0]
    seen = {"start": states()}
    with model.no_sync():
        models.loss_fn(model(inputs[:2]), target[:2]).backward()
    seen["after_no_sync_backward"] = states()
    models.loss_fn(model(inputs[2:4]), target[2:4]).backward()
    seen["after_synced_backward"] = states()
    model.finish_grad_sync()
    seen["after_finish_grad_sync"] = states()
    seen["frozen"] = sorted({group.grad_state.name for group in frozen})
    seen["outer"] = sorted({group.outer_grad_state.name for group in model.groups})
    optimizer.step()
    optimizer.zero_grad()
    seen["after_zero_grad"] = states()

    # A reduction launched for a group with nothing written since zero_grad is a schedule bug: refused by name.
    try:
        model.schedule.launch_reduce(trainable[0], async_op=False)
        seen["reduce_of_nothing"] = "no error"
    except GradStateError as error:
        seen["reduce_of_nothing"] = str(error)
    return seen


@pytest.mark.parametrize("world_size", [2])
def test_states_through_a_step_of_each_strategy(world_size):
    for strategy in (0, 1, 2, 3):
        seen = run_on_ranks(world_size, _states_through_a_step, strategy)[0]
        assert seen["start"] == ["EMPTY"], strategy
        # strategies 0/1 keep no_sync gradients local; 2/3 reduce-scatter every microbatch
        assert seen["after_no_sync_backward"] == (["ACCUMULATING"] if strategy < 2 else ["REDUCED"]), strategy
        assert seen["after_synced_backward"] == ["REDUCED"], strategy
        assert seen["after_finish_grad_sync"] == ["REDUCED"], strategy
        assert seen["frozen"] == ["EMPTY"], strategy
        assert seen["outer"] == ["NONE"], strategy  # no outer dim: the outer machine never moves
        assert seen["after_zero_grad"] == ["EMPTY"], strategy
        assert "GradState.EMPTY to GradState.REDUCED" in seen["reduce_of_nothing"], strategy


def _outer_states_under_hsdp(strategy, use_no_sync):
    from tests.unit_tests.distributed.fsdp.test_hfsdp import _mesh_kwargs

    import megatron_fsdp

    module = models.make_model(0)
    optimizer = models.make_optimizer([p for p in module.parameters() if p.requires_grad])
    model, optimizer = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[models.Block],
                                                 zero_dp_strategy=strategy,
                                                 **dict(_mesh_kwargs(), outer_dp_sharding_strategy="no_shard"))
    trainable = [group for group in model.groups if group.trainable]
    inputs, target = models.make_batches(1)[0]
    context = model.no_sync() if use_no_sync else models._null()
    with context:
        models.loss_fn(model(inputs[:1]), target[:1]).backward()
    after_first = sorted({group.outer_grad_state.name for group in trainable})
    models.loss_fn(model(inputs[1:2]), target[1:2]).backward()
    after_second = sorted({group.outer_grad_state.name for group in trainable})
    model.finish_grad_sync()
    after_finish = sorted({group.outer_grad_state.name for group in trainable})
    return after_first, after_second, after_finish


@pytest.mark.parametrize("world_size", [4])
def test_outer_states_under_hsdp(world_size):
    for strategy in (0, 1, 2, 3):
        for use_no_sync in (True, False):
            first, second, finish = run_on_ranks(world_size, _outer_states_under_hsdp, strategy, use_no_sync)[0]
            if use_no_sync:
                # strategies 0/1 reduce nothing under no_sync; 2/3 reduce-scatter, but the outer reduction waits
                assert first == (["NONE"] if strategy < 2 else ["DUE"]), strategy
            else:
                assert first == ["REDUCED"], strategy  # started during the backward
            assert second == ["REDUCED"] and finish == ["REDUCED"], (strategy, use_no_sync)

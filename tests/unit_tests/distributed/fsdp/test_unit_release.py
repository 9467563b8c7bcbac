"""Units are reduced and released by a module-level post-backward (when their inputs' gradients exist), not by
counting parameter gradients: a parameter unused in forward or a frozen layer inside a unit no longer keeps the
unit gathered to the end of the backward, and reentrant activation checkpointing trains exactly."""

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS = 3


class UnitWithIdleParams(nn.Module):
    """A unit with a parameter the forward never uses and a frozen layer (a group of its own)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(models.HIDDEN, models.HIDDEN)
        self.unused = nn.Linear(models.HIDDEN, models.HIDDEN)
        self.frozen = nn.Linear(models.HIDDEN, models.HIDDEN)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return x + self.fc(torch.tanh(self.frozen(x)))


class IdleParamsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(models.IN_FEATURES, models.HIDDEN)
        self.units = nn.ModuleList([UnitWithIdleParams() for _ in range(3)])
        self.out = nn.Linear(models.HIDDEN, models.IN_FEATURES)

    def forward(self, x, probes=()):
        h = self.inp(x)
        for index, unit in enumerate(self.units):
            if index in probes and h.requires_grad:
                h.register_hook(probes[index])  # runs once every later unit's backward is done
            h = unit(h)
        return self.out(h)


class ReentrantCheckpointModel(models.TinyModel):
    """TinyModel (a weight tied between the root and unit 0) with reentrant checkpointing around every block, and
    a root layer in front, so that the backward of the root's `inp` layer needs its (tied) weight last: the tied
    weight's gradient arrives twice, once in the nested checkpoint backward, and must not release it early."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(models.IN_FEATURES, models.IN_FEATURES)

    def forward(self, x):
        h = self.inp(torch.tanh(self.pre(x))) * self.scale.weight + self.offset
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True)
        h = h + 0.1 * self.frozen(h)
        return self.out(h) + self.tiny.weight.sum() + self.empty.weight.sum()


def _sharded_idle_params_model():
    """(model, optimizer, reference): IdleParamsModel sharded with one unit per UnitWithIdleParams, and an unsharded
    copy with the same initial weights for the single-process reference losses."""
    import megatron_fsdp

    torch.manual_seed(0)
    module = IdleParamsModel()
    reference = IdleParamsModel()
    reference.load_state_dict(module.state_dict())
    model, optimizer = megatron_fsdp.fully_shard(module, models.make_optimizer(
        [p for p in module.parameters() if p.requires_grad]), fsdp_unit_modules=[UnitWithIdleParams])
    return model, optimizer, reference


def _idle_params_release_and_train():
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer, reference = _sharded_idle_params_model()
    held, states = [], []

    def probe(grad):
        # unit 0's backward has not started; units 1 and 2 (every group of them) must be released already
        held.append([sum(group.compute_bytes_held() for group in unit.groups) for unit in model.units])
        states.append([sorted(group.weight_state.value for group in unit.groups) for unit in model.units])
        return grad

    losses = []
    for inputs, target in models.make_batches(NUM_STEPS):
        optimizer.zero_grad()
        local = [models.local_slice(t, rank, world) for t in (inputs, target)]
        loss = models.loss_fn(model(local[0], {1: probe}), local[1])
        loss.backward()
        optimizer.step()
        losses.append(models.global_mean(loss.item()))
    reference_losses = models.train_single_process(reference, NUM_STEPS)[:NUM_STEPS]
    unit_group_kinds = [sorted(group.trainable for group in unit.groups) for unit in model.units]
    return held, states, losses, reference_losses, unit_group_kinds


@pytest.mark.parametrize("world_size", [2])
def test_unused_and_frozen_parameters_do_not_keep_a_unit_gathered(world_size):
    for held, states, losses, reference_losses, unit_group_kinds in run_on_ranks(world_size,
                                                                             _idle_params_release_and_train):
        assert unit_group_kinds == [[False, True]] * 3  # a frozen group and a trainable one per unit
        assert len(held) == NUM_STEPS
        for per_unit in held:
            assert per_unit[0] > 0  # unit 0 is gathered for its own backward (the probe runs right before it)
            assert per_unit[1:] == [0, 0], per_unit
        # the groups own their state: unit 0 gathered for its backward, units 1 and 2 back to their shards
        assert states == [[["gathered", "gathered"], ["sharded", "sharded"], ["sharded", "sharded"]]] * NUM_STEPS
        assert losses == pytest.approx(reference_losses, abs=1e-5)


def _train_reentrant(strategy, overlap):
    import megatron_fsdp

    torch.manual_seed(0)
    module = ReentrantCheckpointModel()
    optimizer = models.make_optimizer([p for p in module.parameters() if p.requires_grad])
    model, optimizer = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[models.Block],
                                                 zero_dp_strategy=strategy, overlap_grad_reduce=overlap,
                                                 overlap_param_gather=overlap)
    return models.train_sharded(model, optimizer, NUM_STEPS, microbatches=2)


class PlainModel(ReentrantCheckpointModel):
    def forward(self, x):
        with _checkpoint_disabled():
            return super().forward(x)


class _checkpoint_disabled:
    def __enter__(self):
        self.original = torch.utils.checkpoint.checkpoint
        torch.utils.checkpoint.checkpoint = lambda function, *args, **kwargs: function(*args)

    def __exit__(self, *exc):
        torch.utils.checkpoint.checkpoint = self.original
        return False


def _reference_losses():
    torch.manual_seed(0)
    model = PlainModel()
    optimizer = models.make_optimizer([p for p in model.parameters() if p.requires_grad])
    batches = models.make_batches(NUM_STEPS + 1)
    losses = []
    for step, (inputs, target) in enumerate(batches):
        loss = models.loss_fn(model(inputs), target)
        losses.append(loss.item())
        if step < NUM_STEPS:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return losses


def _reentrant_matrix():
    # strategy 0 reduces persistent buffers, strategy 3 also gathers and releases inside the nested backward
    return {(strategy, overlap): _train_reentrant(strategy, overlap) for strategy, overlap in ((0, True), (3, True),
                                                                                            (3, False))}


@pytest.mark.parametrize("world_size", [2])
def test_reentrant_activation_checkpointing_trains_exactly(world_size):
    reference = _reference_losses()
    for case, losses in run_on_ranks(world_size, _reentrant_matrix)[0].items():
        assert losses == pytest.approx(reference, abs=1e-5), case


def _last_unit_between_forward_and_backward():
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for keep in (True, False):
        model, optimizer, reference = _sharded_idle_params_model()
        model.schedule.keep_last_unit_for_backward = keep
        model.schedule.coalesce_gather_bytes = 0  # one all-gather per group (test_coalesced_gathers.py: together)
        after_forward, after_backward, gathers, losses = [], [], [], []
        for inputs, target in models.make_batches(NUM_STEPS):
            optimizer.zero_grad()
            local = [models.local_slice(t, rank, world) for t in (inputs, target)]
            calls_before = model.counter.calls.get("all_gather", 0)
            loss = models.loss_fn(model(local[0]), local[1])
            after_forward.append([sorted(group.weight_state.value for group in unit.groups) for unit in model.units])
            loss.backward()
            after_backward.append([sum(group.compute_bytes_held() for group in unit.groups) for unit in model.units])
            gathers.append(model.counter.calls.get("all_gather", 0) - calls_before)
            optimizer.step()
            losses.append(models.global_mean(loss.item()))
        reference_losses = models.train_single_process(reference, NUM_STEPS)[:NUM_STEPS]
        results[keep] = (after_forward, after_backward, gathers, losses, reference_losses)
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_last_unit_stays_gathered_from_its_forward_to_its_backward(world_size):
    """The backward starts with the last unit of the forward: kept gathered, it is not gathered a second time (one
    all-gather less per step, both of its groups), and it is released by its post-backward like the others."""
    for results in run_on_ranks(world_size, _last_unit_between_forward_and_backward):
        kept, released = results[True], results[False]
        assert kept[0] == [[["sharded", "sharded"], ["sharded", "sharded"], ["gathered", "gathered"]]] * NUM_STEPS
        assert released[0] == [[["sharded", "sharded"]] * 3] * NUM_STEPS
        for after_backward in (kept[1], released[1]):
            assert after_backward == [[0, 0, 0]] * NUM_STEPS  # every unit released at the end of the backward
        # per step: each unit's two groups and the root group gathered in forward, the units again in backward
        # (the root group stays gathered), minus the last unit's two groups when it is kept
        assert released[2] == [2 * 2 * 3 + 1] * NUM_STEPS
        assert kept[2] == [2 * 2 * 3 + 1 - 2] * NUM_STEPS
        for losses, reference_losses in ((kept[3], kept[4]), (released[3], released[4])):
            assert losses == pytest.approx(reference_losses, abs=1e-5)
        assert kept[3] == released[3]  # same arithmetic, only the gather schedule differs


def _microbatch_boundaries(all_no_sync: bool):
    """Per keep setting: the root's and each unit's weight states after every microbatch's backward, all-gathers per
    step, compute bytes still held after the step's last backward, and the losses. Each rank's rows of the batch in
    microbatches of two rows (three on 2 ranks, two on 3), all but the last under no_sync (`all_no_sync`: all of
    them, and the step follows a no_sync backward)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    microbatches = models.GLOBAL_BATCH // world // 2
    results = {}
    for keep in (True, False):
        model, optimizer, reference = _sharded_idle_params_model()
        model.schedule.keep_first_unit_between_microbatches = keep
        model.schedule.coalesce_gather_bytes = 0  # one all-gather per group (test_coalesced_gathers.py: together)
        states, gathers, held_after_step, losses = [], [], [], []
        for inputs, target in models.make_batches(NUM_STEPS):
            optimizer.zero_grad()
            local = [models.local_slice(t, rank, world) for t in (inputs, target)]
            chunk = local[0].shape[0] // microbatches
            calls_before = model.counter.calls.get("all_gather", 0)
            total = 0.0
            for micro in range(microbatches):
                part = slice(micro * chunk, (micro + 1) * chunk)
                synced = micro == microbatches - 1 and not all_no_sync
                with (models._null() if synced else model.no_sync()):
                    loss = models.loss_fn(model(local[0][part]), local[1][part]) / microbatches
                    loss.backward()
                total += loss.item()
                states.append([sorted(g.weight_state.value for g in model.root_groups)]
                              + [sorted(g.weight_state.value for g in unit.groups) for unit in model.units])
            gathers.append(model.counter.calls.get("all_gather", 0) - calls_before)
            optimizer.step()
            held_after_step.append(sum(group.compute_bytes_held() for group in model.groups))
            losses.append(models.global_mean(total))
        reference_losses = models.train_single_process(reference, NUM_STEPS)[:NUM_STEPS]
        unit0_groups = len(model.units[0].groups)
        results[keep] = (states, gathers, held_after_step, losses, reference_losses, len(model.root_groups),
                         unit0_groups, microbatches)
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_root_and_first_unit_stay_gathered_between_no_sync_microbatches(world_size):
    """Inside no_sync the next microbatch's forward starts with the root groups and the first unit, the last ones a
    backward releases: they stay gathered across the boundary (one all-gather less per group and boundary), every
    group is released by the synced microbatch's backward, and the losses are the same either way."""
    for results in run_on_ranks(world_size, _microbatch_boundaries, False):
        kept, released = results[True], results[False]
        root_groups, unit0_groups = kept[5], kept[6]
        assert root_groups >= 1 and unit0_groups == 2  # unit 0: a trainable group and a frozen one
        gathered = ["gathered"]
        held_state = [gathered * root_groups, gathered * unit0_groups, ["sharded"] * 2, ["sharded"] * 2]
        rest_state = [["sharded"] * root_groups, ["sharded"] * 2, ["sharded"] * 2, ["sharded"] * 2]
        boundaries = kept[7] - 1
        assert kept[0] == ([held_state] * boundaries + [rest_state]) * NUM_STEPS
        assert released[0] == [rest_state] * kept[7] * NUM_STEPS
        assert [a - b for a, b in zip(released[1], kept[1])] == [boundaries * (root_groups + unit0_groups)] * NUM_STEPS
        assert kept[2] == released[2] == [0] * NUM_STEPS  # nothing gathered after the step
        assert kept[3] == released[3]  # same arithmetic, only the gather schedule differs
        assert kept[3] == pytest.approx(kept[4], abs=1e-5)


@pytest.mark.parametrize("world_size", [2])
def test_a_step_after_a_no_sync_backward_regathers_the_weights_kept_for_the_next_microbatch(world_size):
    """A loop that runs every microbatch under no_sync and then steps (strategy 3 reduces every microbatch anyway):
    the groups kept gathered across the last boundary hold the old weights; the step re-gathers them, so the next
    forward computes with the new ones and training matches the run that releases them."""
    for results in run_on_ranks(world_size, _microbatch_boundaries, True):
        kept, released = results[True], results[False]
        assert kept[3] == released[3]
        assert kept[3] == pytest.approx(kept[4], abs=1e-5)

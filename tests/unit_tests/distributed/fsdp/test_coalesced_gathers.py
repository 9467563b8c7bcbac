"""Small all-gathers posted together (`GatherReleasePolicy.coalesce_gather_bytes`, `coalesced_gathers.py`).

The toy model's groups are a few hundred bytes each, far under the default threshold, so under ZeRO-3 a prefetch
takes every following unit along, the gathers one call starts go out as one exchange, and the units stay
gathered from their forward to their backward. Training must be bit-identical to the schedule that gathers each
group on its own (`coalesce_gather_bytes = 0`), with fewer exchanges, and the units gathered ahead of their use or
kept for the backward must stay within the threshold.
"""

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS = 2
MICROBATCHES = 2


def _train(coalesce_gather_bytes):
    """(losses, final main weights, all-gather calls a step, bytes sent by gathers a step, each unit's gathered
    bytes, groups)."""
    import megatron_fsdp
    from megatron_fsdp import collectives

    model = models.make_model(0)
    optimizer = models.make_optimizer([p for p in model.parameters() if p.requires_grad])
    model, optimizer = megatron_fsdp.fully_shard(model, optimizer, fsdp_unit_modules=[models.Block],
                                                 zero_dp_strategy=3)
    model.schedule.coalesce_gather_bytes = coalesce_gather_bytes
    counter = model.schedule.counter
    counter.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = models.make_batches(NUM_STEPS)
    losses = []
    for inputs, target in batches:
        inputs, target = (models.local_slice(t, rank, world) for t in (inputs, target))
        optimizer.zero_grad()
        chunk, total = inputs.shape[0] // MICROBATCHES, 0.0
        for micro in range(MICROBATCHES):
            part = slice(micro * chunk, (micro + 1) * chunk)
            with model.no_sync() if micro < MICROBATCHES - 1 else models._null():
                loss = models.loss_fn(model(inputs[part]), target[part]) / MICROBATCHES
                loss.backward()
            total += loss.item()
        losses.append(models.global_mean(total))
        optimizer.step()
    weights = [group.main_weights_flat().clone() for group in model.groups if group.main_weights is not None]
    return (losses, weights, counter.calls[collectives.ALL_GATHER] / NUM_STEPS,
            counter.bytes_sent[collectives.ALL_GATHER] / NUM_STEPS,
            [sum(group.layout.padded_numel * group.param_dtype.itemsize for group in unit.groups)
             for unit in model.units], len(model.groups))


def _coalesced_and_separate():
    from megatron_fsdp.gather_policy import COALESCE_GATHER_BYTES

    return _train(COALESCE_GATHER_BYTES), _train(0)


@pytest.mark.parametrize("world_size", [2, 3])
def test_small_gathers_go_out_together_with_identical_training(world_size):
    for coalesced, separate in run_on_ranks(world_size, _coalesced_and_separate):
        losses, weights, calls, sent, unit_bytes, groups = coalesced
        separate_losses, separate_weights, separate_calls, separate_sent, _, _ = separate
        assert len(unit_bytes) == 3 and groups > 3
        # Per step: the first microbatch's forward gathers the root groups and all three units at its start, and
        # the units stay gathered for the backward (all three fit in the threshold); the second microbatch's
        # forward starts with the root groups and unit 0 still gathered (no_sync) and gathers units 1 and 2
        # together: two exchanges, where each group gathered on its own in forward and again in backward.
        assert calls == 2
        assert separate_calls > 2 * calls
        # what is not sent: units 0 and 1 gathered again for each microbatch's backward (each rank sends its
        # shard, 1/world of a unit, to every other rank)
        assert separate_sent - sent == pytest.approx(MICROBATCHES * (unit_bytes[0] + unit_bytes[1])
                                                     * (world_size - 1) / world_size, rel=1e-9)
        assert losses == separate_losses  # bit-identical, not approximately equal
        assert len(weights) == len(separate_weights)
        for mine, theirs in zip(weights, separate_weights):
            assert torch.equal(mine, theirs)


def _four_units_with_threshold_in_units(coalesce_gather_bytes_in_units):
    """(model, one unit's gathered bytes, units gathered now): the toy model with four units under ZeRO-3, its
    threshold set to that many units' gathered bytes plus one."""
    import megatron_fsdp

    model = models.make_model(0, num_blocks=4)
    model, _ = megatron_fsdp.fully_shard(model, models.make_optimizer(model.parameters()),
                                         fsdp_unit_modules=[models.Block], zero_dp_strategy=3)
    schedule = model.schedule
    unit_bytes = sum(schedule._gather_bytes(group) for group in schedule.units[1].groups)
    schedule.coalesce_gather_bytes = coalesce_gather_bytes_in_units * unit_bytes + 1
    return model, unit_bytes, lambda: [any(group.gathered for group in unit.groups) for unit in schedule.units]


def _units_gathered_at_first_forward(coalesce_gather_bytes_in_units):
    """Which units hold (or are gathering) their weights when unit 0's forward starts, with the threshold set to
    that many units' gathered bytes plus one; and the bytes of one unit."""
    model, unit_bytes, gathered_units = _four_units_with_threshold_in_units(coalesce_gather_bytes_in_units)
    seen = []
    # registered after Megatron-FSDP's pre-forward hook, which gathers unit 0 and prefetches what follows it
    handle = model.schedule.units[0].module.register_forward_pre_hook(lambda *_: seen.append(gathered_units()))
    with torch.no_grad():
        model(torch.randn(2, models.IN_FEATURES))
    handle.remove()
    return seen, unit_bytes


@pytest.mark.parametrize("units_ahead", [0, 1, 2, 3])
def test_a_prefetch_takes_following_units_along_only_within_the_threshold(units_ahead):
    for seen, unit_bytes in run_on_ranks(2, _units_gathered_at_first_forward, units_ahead):
        assert unit_bytes > 0
        # unit 0 and, prefetched, unit 1 whatever the threshold (0: nothing coalesces; 1: the root's prefetch of
        # unit 0 takes unit 1 along); then one more unit for each unit's bytes the threshold holds
        gathered = min(4, max(2, 1 + units_ahead))
        assert seen == [[index < gathered for index in range(4)]], (units_ahead, seen)


def _units_gathered_between_forward_and_backward(coalesce_gather_bytes_in_units):
    """Which units hold their weights after a forward with grad and after its backward, with the threshold set to
    that many units' gathered bytes plus one."""
    model, _, gathered_units = _four_units_with_threshold_in_units(coalesce_gather_bytes_in_units)
    output = model(torch.randn(2, models.IN_FEATURES))
    after_forward = gathered_units()
    output.square().mean().backward()
    return after_forward, gathered_units()


@pytest.mark.parametrize("units_kept", [0, 1, 2, 3])
def test_small_units_stay_gathered_for_their_backward_only_within_the_threshold(units_kept):
    for after_forward, after_backward in run_on_ranks(2, _units_gathered_between_forward_and_backward, units_kept):
        # the last unit always (keep_last_unit_for_backward), then the units before it, from the end, as many as
        # the threshold holds
        assert after_forward == [index >= 3 - units_kept for index in range(4)], (units_kept, after_forward)
        assert after_backward == [False] * 4  # each released by its post-backward


def _coalesced_against_separate():
    """The outputs of one coalesced gather of three pieces lists and of one in-place gather each."""
    from megatron_fsdp import collectives
    from megatron_fsdp.coalesced_gathers import CoalescedGathers

    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(100 + rank)
    # per gather: the piece sizes; one piece over collectives.PACKED_PIECE_BYTES travels on its own
    sizes = [(3, 5), (1,), (collectives.PACKED_PIECE_BYTES // 4 + 3, 2)]
    own = [[torch.randn(n, generator=generator) for n in piece_sizes] for piece_sizes in sizes]

    def outputs():
        return [[[torch.full((n,), -1.0) for n in piece_sizes] for _ in range(world)] for piece_sizes in sizes]

    counter = collectives.CommunicationCounter()
    coalesced = outputs()
    batch = CoalescedGathers(lambda group, by_rank, pieces: collectives.all_gather_pieces_in_place(
        by_rank, pieces, group, counter, async_op=True))
    handles = [batch.add(dist.group.WORLD, sum(n for n in piece_sizes) * 4 * world, coalesced[i], own[i])
               for i, piece_sizes in enumerate(sizes)]
    held = batch.held_bytes(dist.group.WORLD)
    handles[1].wait()  # waiting for any one posts the exchange and lands all of them
    for handle in handles:
        handle.wait()
    separate_counter = collectives.CommunicationCounter()
    separate = outputs()
    for i in range(len(sizes)):
        collectives.all_gather_pieces_in_place(separate[i], own[i], dist.group.WORLD, separate_counter)
    return coalesced, separate, dict(counter.calls), counter.snapshot(), separate_counter.snapshot(), held, sizes


@pytest.mark.parametrize("world_size", [2, 3])
def test_coalesced_gather_lands_every_piece_where_its_own_gather_does(world_size):
    for coalesced, separate, calls, sent, separate_sent, held, sizes in run_on_ranks(world_size,
                                                                                      _coalesced_against_separate):
        assert calls == {"all_gather": 1}
        assert sent == separate_sent
        assert held == sum(4 * world_size * sum(piece_sizes) for piece_sizes in sizes)
        for mine, theirs in zip(coalesced, separate):
            for mine_rank, their_rank in zip(mine, theirs):
                for a, b in zip(mine_rank, their_rank):
                    assert not torch.equal(a, torch.full_like(a, -1.0))  # written
                    assert torch.equal(a, b)

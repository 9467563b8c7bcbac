"""Small all-gathers posted together (`GatherReleasePolicy.coalesce_gather_bytes`, `coalesced_gathers.py`).

The toy model's groups are a few hundred bytes each, far under the default threshold, so under ZeRO-3 a prefetch
takes every following unit along and the gathers one call starts go out as one exchange. Training must be
bit-identical to the schedule that gathers each group on its own (`coalesce_gather_bytes = 0`), with fewer
exchanges, and the units gathered ahead of their use must stay within the threshold.
"""

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS = 2
MICROBATCHES = 2


def _train(coalesce_gather_bytes):
    """(losses, final main weights, all-gather calls a step, bytes gathered a step, units, groups)."""
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
            counter.bytes_sent[collectives.ALL_GATHER] / NUM_STEPS, len(model.units), len(model.groups))


def _coalesced_and_separate():
    from megatron_fsdp.gather_policy import COALESCE_GATHER_BYTES

    return _train(COALESCE_GATHER_BYTES), _train(0)


@pytest.mark.parametrize("world_size", [2, 3])
def test_small_gathers_go_out_together_with_identical_training(world_size):
    for coalesced, separate in run_on_ranks(world_size, _coalesced_and_separate):
        losses, weights, calls, sent, units, groups = coalesced
        separate_losses, separate_weights, separate_calls, separate_sent, _, _ = separate
        assert units == 3 and groups > units
        # Per step: the first microbatch's forward gathers the root groups and all three units at its start, its
        # backward units 1 and 0 together (unit 2 stays gathered from its forward); the second microbatch's
        # forward starts with the root groups and unit 0 still gathered (no_sync) and gathers units 1 and 2 together,
        # its backward units 1 and 0: four exchanges.
        assert calls == 4
        assert separate_calls > 2 * calls
        assert sent == separate_sent  # the same bytes travel, in fewer exchanges
        assert losses == separate_losses  # bit-identical, not approximately equal
        assert len(weights) == len(separate_weights)
        for mine, theirs in zip(weights, separate_weights):
            assert torch.equal(mine, theirs)


def _units_gathered_at_first_forward(coalesce_gather_bytes_in_units):
    """Which units hold (or are gathering) their weights when unit 0's forward starts, with the threshold set to
    that many units' gathered bytes plus one; and the bytes of one unit."""
    import megatron_fsdp

    model = models.make_model(0, num_blocks=4)
    model, _ = megatron_fsdp.fully_shard(model, models.make_optimizer(model.parameters()),
                                         fsdp_unit_modules=[models.Block], zero_dp_strategy=3)
    schedule = model.schedule
    unit_bytes = sum(schedule._gather_bytes(group) for group in schedule.units[1].groups)
    schedule.coalesce_gather_bytes = coalesce_gather_bytes_in_units * unit_bytes + 1
    seen = []
    # registered after Megatron-FSDP's pre-forward hook, which gathers unit 0 and prefetches what follows it
    handle = schedule.units[0].module.register_forward_pre_hook(
        lambda *_: seen.append([any(group.gathered for group in unit.groups) for unit in schedule.units]))
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

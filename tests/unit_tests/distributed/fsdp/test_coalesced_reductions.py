"""Small reduce-scatters held and issued together (`GradReductionPipeline.coalesce_reduce_bytes`,
`collectives.reduce_scatter_coalesced`).

The toy model's groups are a few hundred bytes each, far under the default threshold, so under ZeRO-2/3 with two
microbatches (the first under `no_sync`) the step's reductions over the data-parallel group go out as one exchange
at the end of the last microbatch's backward (the no_sync microbatch's stay held until then) instead of one per
group and microbatch. Training must be bit-identical to the schedule
that issues each reduction on its own (`coalesce_reduce_bytes = 0`): same losses, same weights.
"""

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS = 2
MICROBATCHES = 2


def _train(strategy, coalesce_reduce_bytes):
    """(losses, final main weights, reduce-scatter calls a step, groups reduce-scattered a step)."""
    import megatron_fsdp
    from megatron_fsdp import collectives

    model = models.make_model(0)
    optimizer = models.make_optimizer([p for p in model.parameters() if p.requires_grad])
    model, optimizer = megatron_fsdp.fully_shard(model, optimizer, fsdp_unit_modules=[models.Block],
                                                 zero_dp_strategy=strategy)
    model.schedule.coalesce_reduce_bytes = coalesce_reduce_bytes
    counter = model.schedule.counter
    counter.reset()
    losses = models.train_sharded(model, optimizer, NUM_STEPS, microbatches=MICROBATCHES)
    weights = [group.main_weights_flat().clone() for group in model.groups if group.main_weights is not None]
    sharded = [group for group in model.groups
               if group.trainable and collectives.group_size(model.schedule._shard_group(group)) > 1]
    return losses, weights, counter.calls[collectives.REDUCE_SCATTER] / NUM_STEPS, len(sharded)


def _held_and_separate(strategy):
    from megatron_fsdp.grad_reduction import COALESCE_REDUCE_BYTES

    return _train(strategy, COALESCE_REDUCE_BYTES), _train(strategy, 0)


@pytest.mark.parametrize("strategy", [2, 3])
def test_small_reductions_go_out_as_one_exchange_per_microbatch_with_identical_training(strategy):
    for held, separate in run_on_ranks(2, _held_and_separate, strategy):
        held_losses, held_weights, held_calls, groups = held
        separate_losses, separate_weights, separate_calls, _ = separate
        assert groups >= 3  # several groups are reduced each microbatch: there is something to coalesce
        assert separate_calls == groups * MICROBATCHES
        # one exchange a step: the no_sync microbatch's reductions stay held and go out with the last one's at the
        # end of its backward
        assert held_calls == 1
        assert held_losses == separate_losses  # bit-identical, not approximately equal
        assert len(held_weights) == len(separate_weights)
        for mine, theirs in zip(held_weights, separate_weights):
            assert torch.equal(mine, theirs)


def _coalesced_against_separate(point_to_point):
    """Outputs of one coalesced reduce-scatter and of one reduce-scatter per input, on the same inputs."""
    from megatron_fsdp import collectives

    previous, collectives.GLOO_POINT_TO_POINT = collectives.GLOO_POINT_TO_POINT, point_to_point
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        generator = torch.Generator().manual_seed(100 + rank)
        inputs = [torch.randn(world * numel, generator=generator) for numel in (5, 1, 12)]
        starts = [torch.randn(numel, generator=generator) for numel in (5, 1, 12)]
        results = {}
        for average in (False, True):
            counter = collectives.CommunicationCounter()
            coalesced = [start.clone() for start in starts]
            collectives.reduce_scatter_coalesced(coalesced, inputs, dist.group.WORLD, counter, average=average,
                                                 accumulate=True, async_op=True).wait()
            separate = [start.clone() for start in starts]
            separate_counter = collectives.CommunicationCounter()
            for output, flat in zip(separate, inputs):
                collectives.reduce_scatter_flat(output, flat, dist.group.WORLD, separate_counter, average=average,
                                                accumulate=True)
            results[average] = (coalesced, separate, dict(counter.calls), counter.snapshot(),
                                separate_counter.snapshot())
        return results
    finally:
        collectives.GLOO_POINT_TO_POINT = previous


@pytest.mark.parametrize("point_to_point", [True, False])
def test_coalesced_reduce_scatter_equals_one_per_input(point_to_point):
    for per_rank in run_on_ranks(2, _coalesced_against_separate, point_to_point):
        for average, (coalesced, separate, calls, sent, separate_sent) in per_rank.items():
            assert calls == {"reduce_scatter": 1}, average
            assert sent == separate_sent  # the same bytes travel, in one exchange
            for mine, theirs in zip(coalesced, separate):
                assert torch.equal(mine, theirs), average

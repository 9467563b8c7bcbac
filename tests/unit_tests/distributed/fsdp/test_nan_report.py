"""`report_nan_in_param_grad`: a NaN in one rank's gradients makes every rank raise the same error, after the
reduction, and leaves the process group usable (no rank is left waiting in a collective)."""

import pytest
import torch

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks


def _nan_on_last_rank():
    import torch.distributed as dist

    import megatron_fsdp

    rank, world = dist.get_rank(), dist.get_world_size()
    outcomes = {}
    for strategy in range(4):
        model = models.make_model(0)
        optimizer = models.make_optimizer([p for p in model.parameters() if p.requires_grad])
        model, optimizer = megatron_fsdp.fully_shard(model, optimizer, fsdp_unit_modules=[models.Block],
                                                     zero_dp_strategy=strategy, report_nan_in_param_grad=True)
        inputs, target = (models.local_slice(t, rank, world) for t in models.make_batches(1)[0])
        # a clean step first: the check must not fire on finite gradients
        models.loss_fn(model(inputs), target).backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == world - 1:
            inputs = inputs.clone()
            inputs[0, 0] = float("nan")
        models.loss_fn(model(inputs), target).backward()
        try:
            optimizer.step()
            outcomes[strategy] = None
        except RuntimeError as error:
            outcomes[strategy] = str(error)
        optimizer.zero_grad()
    alive = torch.ones(1)
    dist.all_reduce(alive)  # every rank reached this point: nobody is stuck in a collective
    return outcomes, alive.item()


@pytest.mark.parametrize("world_size", [2])
def test_nan_on_one_rank_raises_the_same_error_on_every_rank(world_size):
    results = run_on_ranks(world_size, _nan_on_last_rank)
    for outcomes, alive in results:
        assert alive == world_size
        for strategy, message in outcomes.items():
            assert message is not None, strategy
            assert "report_nan_in_param_grad=True" in message and "'inp.weight'" in message, message
            assert message == results[0][0][strategy]  # identical on every rank

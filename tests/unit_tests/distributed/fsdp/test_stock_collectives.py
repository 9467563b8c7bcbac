"""The stock-collective code path, the one NCCL takes, run on gloo: Megatron-FSDP must train exactly as the
single-process reference when all-gathers and reduce-scatters go through torch's own collectives (AVG op and
the cast-and-store epilogue included) instead of gloo's point-to-point exchange."""

import pytest
import torch

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS = 3


def _train_on_stock_collectives():
    import torch.distributed as dist

    import megatron_fsdp
    from megatron_fsdp import collectives

    point_to_point_calls = []
    original_isend = dist.isend
    collectives.GLOO_POINT_TO_POINT = False
    dist.isend = lambda *args, **kwargs: point_to_point_calls.append(1) or original_isend(*args, **kwargs)
    try:
        results = {}
        # every strategy, and the AVG reduce op of the stock all-reduce and reduce-scatter
        for strategy, average in ((0, False), (1, False), (2, False), (3, False), (0, True), (3, True)):
            model = models.make_model(0)
            optimizer = models.make_optimizer([p for p in model.parameters() if p.requires_grad])
            model, optimizer = megatron_fsdp.fully_shard(model, optimizer, fsdp_unit_modules=[models.Block],
                                                         zero_dp_strategy=strategy, average_in_collective=average)
            results[(strategy, average)] = models.train_sharded(model, optimizer, NUM_STEPS, microbatches=2)
    finally:
        collectives.GLOO_POINT_TO_POINT = True
        dist.isend = original_isend
    return results, len(point_to_point_calls)


@pytest.mark.parametrize("world_size", [3])
def test_stock_collectives_match_single_process(world_size):
    reference, _ = models.reference_losses(NUM_STEPS)
    for results, point_to_point_calls in run_on_ranks(world_size, _train_on_stock_collectives):
        assert point_to_point_calls == 0
        for case, losses in results.items():
            assert losses == pytest.approx(reference, abs=1e-5), case

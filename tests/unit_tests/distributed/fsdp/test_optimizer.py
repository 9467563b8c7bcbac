"""`fully_shard_optimizer` with torch optimizers that keep more than their param groups: LBFGS steps its own list
of the parameters and takes inner products over all of them, so it trains like a single process under no_shard
(its list re-pointed at the main weights) and is refused, naming the strategy to use, under the sharded ones.
Adafactor (row and column statistics of each matrix) and Muon (each matrix orthogonalised whole) also need
whole parameters: they train like torch under no_shard and are refused under the sharded strategies."""

import pytest
import torch

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS = 3
LBFGS_SETTINGS = {"lr": 0.5, "max_iter": 5, "line_search_fn": "strong_wolfe"}


def _make_lbfgs(module):
    return torch.optim.LBFGS([p for p in module.parameters() if p.requires_grad], **LBFGS_SETTINGS)


def _lbfgs_losses(model, optimizer, inputs, target):
    losses = []
    for _ in range(NUM_STEPS):
        def closure():
            optimizer.zero_grad()
            loss = models.loss_fn(model(inputs), target)
            loss.backward()
            return loss

        losses.append(optimizer.step(closure).item())
    with torch.no_grad():
        losses.append(models.loss_fn(model(inputs), target).item())
    return losses


def _reference_lbfgs_losses():
    module = models.make_model(0)
    return _lbfgs_losses(module, _make_lbfgs(module), *models.make_batches(1)[0])


def _train_with_lbfgs(strategy):
    import torch.distributed as dist

    import megatron_fsdp

    module = models.make_model(0)
    try:
        model, optimizer = megatron_fsdp.fully_shard(module, _make_lbfgs(module), fsdp_unit_modules=[models.Block],
                                                     zero_dp_strategy=strategy)
    except ValueError as error:
        return str(error)
    inputs, target = (models.local_slice(t, dist.get_rank(), dist.get_world_size()) for t in models.make_batches(1)[0])
    return [models.global_mean(loss) for loss in _lbfgs_losses(model, optimizer, inputs, target)]


@pytest.mark.parametrize("world_size", [2])
def test_lbfgs_trains_like_a_single_process_under_no_shard(world_size):
    reference = _reference_lbfgs_losses()
    assert reference[-1] < 0.5 * reference[0]  # it does train
    for losses in run_on_ranks(world_size, _train_with_lbfgs, 0):
        # rel 1e-4, not 1e-5: the gradients are summed over the ranks in another order than the single process's,
        # and the strong-Wolfe line search's interpolation amplifies that last-bit difference over its 5 inner steps
        assert losses == pytest.approx(reference, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("world_size", [2])
def test_lbfgs_is_refused_under_sharded_strategies(world_size):
    for strategy in (1, 2, 3):
        for message in run_on_ranks(world_size, _train_with_lbfgs, strategy):
            assert isinstance(message, str), strategy
            assert "LBFGS" in message and "zero_dp_strategy='no_shard'" in message, message


WHOLE_MATRIX_OPTIMIZERS = {
    "Adafactor": lambda module: torch.optim.Adafactor([p for p in module.parameters() if p.requires_grad and p.numel()],
                                                      lr=1e-2),
    "Muon": lambda module: torch.optim.Muon([p for p in module.parameters() if p.requires_grad and p.dim() == 2],
                                            lr=1e-2),
}


def _reference_whole_matrix_losses(name):
    module = models.make_model(0)
    optimizer = WHOLE_MATRIX_OPTIMIZERS[name](module)
    losses = []
    for inputs, target in models.make_batches(NUM_STEPS):
        optimizer.zero_grad()
        loss = models.loss_fn(module(inputs), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _train_with_whole_matrix_optimizers():
    import torch.distributed as dist

    import megatron_fsdp

    results = {}
    for name, make_optimizer in WHOLE_MATRIX_OPTIMIZERS.items():
        for strategy in (0, 1, 3):
            module = models.make_model(0)
            try:
                model, optimizer = megatron_fsdp.fully_shard(
                    module, make_optimizer(module), fsdp_unit_modules=[models.Block], zero_dp_strategy=strategy)
            except ValueError as error:
                results[name, strategy] = str(error)
                continue
            losses = []
            for batch in models.make_batches(NUM_STEPS):
                inputs, target = (models.local_slice(t, dist.get_rank(), dist.get_world_size()) for t in batch)
                optimizer.zero_grad()
                loss = models.loss_fn(model(inputs), target)
                loss.backward()
                optimizer.step()
                losses.append(models.global_mean(loss.item()))
            results[name, strategy] = losses
    return results


@pytest.mark.parametrize("world_size", [2])
def test_adafactor_and_muon_train_like_torch_under_no_shard_and_are_refused_when_sharded(world_size):
    for results in run_on_ranks(world_size, _train_with_whole_matrix_optimizers):
        for name in WHOLE_MATRIX_OPTIMIZERS:
            assert results[name, 0] == pytest.approx(_reference_whole_matrix_losses(name), rel=1e-5, abs=1e-6), name
            for strategy in (1, 3):
                message = results[name, strategy]
                assert isinstance(message, str), (name, strategy, message)
                assert f"torch.optim.{name} needs every parameter whole" in message, message
                assert "zero_dp_strategy='no_shard' (0)" in message, message

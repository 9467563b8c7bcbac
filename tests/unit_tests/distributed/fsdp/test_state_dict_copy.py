"""`copy.deepcopy(model.state_dict())` and `torch.save(model.state_dict())` of a `fully_shard` model at any point
of training: after a train step, after an eval forward under no_grad, between microbatches; under strategies
0-3 x outer strategy none / no_shard (HSDP) / optim (HFSDP), at 2 and 4 ranks.

A copy keeps the values of the moment it was taken while training goes on (it is a copy, not a view of the
weights), a saved state dict loads back (`torch.load`) to the same values, and either one loaded into the model
(`load_state_dict`) restores those weights exactly.
"""

import copy
import io

import pytest
import torch

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.distributed.fsdp.test_grad_contract import _mesh_kwargs
from tests.unit_tests.multiprocess_harness import run_on_ranks

MOMENTS = ("after_step", "after_eval_forward", "between_microbatches")


def _local_values(state_dict):
    """Name -> this rank's part of each entry (a DTensor's local tensor), copied."""
    return {name: (value.to_local() if hasattr(value, "to_local") else value).detach().clone()
            for name, value in state_dict.items()}


def _snapshot(model):
    """(deepcopy of the state dict, its torch.save bytes, this rank's values it holds now)."""
    state_dict = model.state_dict()
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    return copy.deepcopy(state_dict), buffer.getvalue(), _local_values(state_dict)


def _copies_through_training(cases):
    import torch.distributed as dist

    import megatron_fsdp

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [tuple(models.local_slice(t, rank, world) for t in batch) for batch in models.make_batches(2)]
    results = {}
    for strategy, outer, mesh_shape in cases:
        module = models.make_model(0)
        optimizer = models.make_optimizer([p for p in module.parameters() if p.requires_grad])
        model, optimizer = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[models.Block],
                                                     zero_dp_strategy=strategy, **_mesh_kwargs(outer, mesh_shape))
        snapshots = {}
        for step, (inputs, target) in enumerate(batches):
            optimizer.zero_grad()
            half = inputs.shape[0] // 2
            for micro, part in enumerate((slice(0, half), slice(half, None))):
                model.set_model_auto_sync(micro == 1)
                (models.loss_fn(model(inputs[part]), target[part]) / 2).backward()
                if step == 1 and micro == 0:
                    snapshots["between_microbatches"] = _snapshot(model)
            optimizer.step()
            if step == 0:
                snapshots["after_step"] = _snapshot(model)
                with torch.no_grad():
                    model(inputs)
                snapshots["after_eval_forward"] = _snapshot(model)
        final = _local_values(model.state_dict())
        outcome = {}
        for moment in MOMENTS:
            copied, saved, expected = snapshots[moment]
            loaded = torch.load(io.BytesIO(saved), weights_only=False)
            copy_kept = _local_values(copied)
            loaded_values = _local_values(loaded)
            model.load_state_dict(copied)
            restored_from_copy = _local_values(model.state_dict())
            model.load_state_dict(loaded)
            restored_from_file = _local_values(model.state_dict())
            outcome[moment] = {
                name: (torch.equal(copy_kept[name], value), torch.equal(loaded_values[name], value),
                       torch.equal(restored_from_copy[name], value), torch.equal(restored_from_file[name], value),
                       torch.equal(final[name], value))
                for name, value in expected.items()}
        results[(strategy, outer, mesh_shape)] = outcome
    return results


def _check(results):
    for case, outcome in results.items():
        assert set(outcome) == set(MOMENTS), case
        for moment, by_name in outcome.items():
            assert by_name, (case, moment)
            for name, (kept, loaded, restored_copy, restored_file, _) in by_name.items():
                assert kept and loaded and restored_copy and restored_file, (case, moment, name)
            # training moved the weights on after each moment: the copies are not views of the live weights
            assert not all(unchanged for *_, unchanged in by_name.values()), (case, moment)


@pytest.mark.parametrize("world_size", [2])
def test_state_dict_copies_at_two_ranks(world_size):
    cases = [(s, None, None) for s in range(4)]
    cases += [(s, "no_shard", (2, 1)) for s in range(4)] + [(3, "optim", (2, 1))]
    for results in run_on_ranks(world_size, _copies_through_training, cases):
        assert len(results) == len(cases)
        _check(results)


@pytest.mark.parametrize("world_size", [4])
def test_state_dict_copies_at_four_ranks(world_size):
    cases = [(1, "no_shard", (2, 2)), (3, "no_shard", (2, 2)), (3, "optim", (2, 2))]
    for results in run_on_ranks(world_size, _copies_through_training, cases):
        assert len(results) == len(cases)
        _check(results)

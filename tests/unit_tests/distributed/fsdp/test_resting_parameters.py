"""Between steps, strategy-3 parameters are DTensors on the real device viewing this rank's piece of the current
weights, and after a backward their `.grad` view this rank's piece of the reduced gradient: torch code that
reads parameters (device, norms, EMA, clip_grad_norm_, storage) works on them, and `gathered_parameters()`
shows the real, full weights."""

import pytest
import torch
import torch.nn as nn

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS = 2
MAX_NORM = 0.05  # below the measured gradient norms (~0.3), so clipping really scales the step
LR = 0.1
EMA_WEIGHT = 0.5


def _sgd(params):
    return torch.optim.SGD(params, lr=LR)


def _reference():
    """Single-process SGD with torch's clip_grad_norm_ and an EMA of the weights; per-step grads and norms."""
    model = models.make_model(0)
    params = dict(model.named_parameters(remove_duplicate=False))
    optimizer = _sgd([p for p in model.parameters() if p.requires_grad])
    ema = {name: p.detach().clone() for name, p in params.items()}
    steps = []
    for inputs, target in models.make_batches(NUM_STEPS):
        optimizer.zero_grad()
        models.loss_fn(model(inputs), target).backward()
        grads = {name: p.grad.clone() for name, p in params.items() if p.grad is not None}
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], MAX_NORM)
        optimizer.step()
        for name, p in params.items():
            ema[name].lerp_(p.detach(), EMA_WEIGHT)
        steps.append({"grads": grads, "clip_norm": norm.item(),
                      "param_norms": {name: p.detach().norm().item() for name, p in params.items()},
                      "params": {name: p.detach().clone() for name, p in params.items()},
                      "ema": {name: value.clone() for name, value in ema.items()}})
    return steps


def _flat_piece_of(full: torch.Tensor, resting) -> torch.Tensor:
    start = resting.flat_offset
    return full.reshape(-1)[start:start + resting.to_local().numel()]


def _resting_behaviour():
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import megatron_fsdp

    rank, world = dist.get_rank(), dist.get_world_size()
    results = {"steps": []}
    unwrapped = models.make_model(0)
    initial = {name: p.detach().clone() for name, p in unwrapped.named_parameters(remove_duplicate=False)}
    model = megatron_fsdp.fully_shard_model(unwrapped, fsdp_unit_modules=[models.Block], zero_dp_strategy=3)
    # Built after wrapping, from the DTensors the module shows now.
    optimizer = megatron_fsdp.fully_shard_optimizer(_sgd([p for p in model.parameters() if p.requires_grad]))

    params = dict(model.module.named_parameters(remove_duplicate=False))
    results["all_dtensors"] = all(isinstance(p, DTensor) and isinstance(p, nn.Parameter) for p in params.values())
    results["device"] = str(next(model.parameters()).device)
    results["shapes"] = {name: tuple(p.shape) for name, p in params.items()}
    results["tied_is_one_parameter"] = model.module.inp.weight is model.module.blocks[0].fc2.weight
    results["initial_full_equal"] = all(torch.equal(p.full_tensor(), initial[name]) for name, p in params.items())
    # zero-copy: the local piece lives in the group's compute shard
    group, index = model.param_to_group[id(model.module.blocks[1].fc1.weight)]
    shard_storage = group.compute_shard.untyped_storage()
    local = model.module.blocks[1].fc1.weight.to_local()
    results["views_shard"] = (local.untyped_storage().data_ptr() == shard_storage.data_ptr(),
                              local.numel() == group.pieces[index].numel)
    try:
        model.module.blocks[1].fc1.weight.redistribute(placements=[])
        results["redistribute_error"] = None
    except RuntimeError as error:
        results["redistribute_error"] = str(error)

    ema = {name: p.detach().clone() for name, p in params.items()}
    batches = models.make_batches(NUM_STEPS)
    for inputs, target in batches:
        inputs, target = models.local_slice(inputs, rank, world), models.local_slice(target, rank, world)
        optimizer.zero_grad()
        results["grads_none_after_zero_grad"] = all(p.grad is None for p in model.parameters())
        models.loss_fn(model(inputs), target).backward()
        params = dict(model.module.named_parameters(remove_duplicate=False))
        step = {"grads": {name: p.grad.full_tensor().clone() for name, p in params.items() if p.grad is not None},
                "grad_types": {type(p.grad).__name__ for p in params.values() if p.grad is not None}}
        step["clip_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).full_tensor())
        optimizer.step()
        step["param_norms"] = {name: float(torch.linalg.vector_norm(p.detach()).full_tensor())
                               for name, p in params.items()}
        step["params"] = {name: p.full_tensor().clone() for name, p in params.items()}
        for name, p in params.items():
            ema[name].lerp_(p.detach(), EMA_WEIGHT)
        step["ema_local"] = {name: (value.to_local().clone(), params[name].flat_offset) for name, value in ema.items()}
        results["steps"].append(step)

    with torch.no_grad():
        model(inputs)
    results["dtensors_after_eval"] = all(isinstance(p, DTensor) for p in model.module.parameters())
    with model.gathered_parameters() as module:
        results["real_inside"] = not any(isinstance(p, DTensor) for p in module.parameters())
        results["gathered"] = {name: p.detach().clone() for name, p in module.named_parameters(remove_duplicate=False)}
    results["dtensors_after_exit"] = all(isinstance(p, DTensor) for p in model.module.parameters())
    results["state_dict"] = models.full_params(model)
    return results


@pytest.mark.parametrize("world_size", [2])
def test_strategy3_parameters_at_rest_are_dtensors_of_this_ranks_piece(world_size):
    reference = _reference()
    plain = dict(models.make_model(0).named_parameters(remove_duplicate=False))
    for rank_result in run_on_ranks(world_size, _resting_behaviour):
        assert rank_result["all_dtensors"] and rank_result["device"] == "cpu"
        assert rank_result["shapes"] == {name: tuple(p.shape) for name, p in plain.items()}
        assert rank_result["tied_is_one_parameter"] and rank_result["initial_full_equal"]
        assert rank_result["views_shard"] == (True, True)
        assert "gathered_parameters" in rank_result["redistribute_error"]
        assert rank_result["grads_none_after_zero_grad"]
        for got, expected in zip(rank_result["steps"], reference):
            assert got["grad_types"] == {"DTensor"}
            assert set(got["grads"]) == set(expected["grads"])
            for name, grad in expected["grads"].items():
                torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)
            assert got["clip_norm"] == pytest.approx(expected["clip_norm"], rel=1e-5)
            for name, value in expected["params"].items():
                torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)
                assert got["param_norms"][name] == pytest.approx(expected["param_norms"][name], rel=1e-5, abs=1e-6)
                local, offset = got["ema_local"][name]
                want = expected["ema"][name].reshape(-1)[offset:offset + local.numel()]
                torch.testing.assert_close(local, want, rtol=1e-5, atol=1e-6, msg=name)
        assert rank_result["dtensors_after_eval"] and rank_result["real_inside"] and rank_result["dtensors_after_exit"]
        gathered = rank_result["gathered"]
        assert set(gathered) == set(reference[-1]["params"])
        for name, value in reference[-1]["params"].items():
            torch.testing.assert_close(gathered[name], value, rtol=1e-5, atol=1e-6, msg=name)
            torch.testing.assert_close(gathered[name], rank_result["state_dict"][name], rtol=0, atol=0, msg=name)


def _strategy1_keeps_real_parameters():
    import megatron_fsdp
    from torch.distributed.tensor import DTensor

    module = models.make_model(0)
    optimizer = models.make_optimizer([p for p in module.parameters() if p.requires_grad])
    model, _ = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[models.Block], zero_dp_strategy=1)
    return not any(isinstance(p, DTensor) for p in model.module.parameters())


@pytest.mark.parametrize("world_size", [2])
def test_other_strategies_keep_real_parameters(world_size):
    assert all(run_on_ranks(world_size, _strategy1_keeps_real_parameters))

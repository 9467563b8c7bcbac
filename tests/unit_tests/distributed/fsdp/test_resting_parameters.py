"""Between steps, strategy-3 parameters are true Shard(0) DTensors on the real device whose local tensor is this
rank's rows (`chunk_rows`) viewing the compute shard, and after a backward their `.grad` are DTensors of this
rank's rows of the reduced gradient: torch code that reads parameters, and every DTensor derived from them
(clones, arithmetic, indexing, reductions along a dim, an EMA, redistribute), gives exact values. A gradient
hook registered on a resting parameter (`p.register_hook(fn)` over `model.parameters()`) acts on the weights
the forward computes with, as under the other strategies, and its handle removes it."""

import pytest
import torch
import torch.nn as nn

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS = 2
MAX_NORM = 0.05  # below the measured gradient norms (~0.3), so clipping really scales the step
LR = 0.1
EMA_WEIGHT = 0.1


class ScalarGainModel(nn.Module):
    """TinyModel (a 2-row vector: fewer rows than ranks at world 3, an empty one, a tied weight, a frozen layer)
    with a 0-dim gain and a 1-element bias on top."""

    def __init__(self):
        super().__init__()
        self.body = models.TinyModel()
        self.gain = nn.Parameter(torch.tensor(1.25))
        self.bias = nn.Parameter(torch.tensor([0.5]))

    def forward(self, x):
        return self.body(x) * self.gain + self.bias


def _make_model():
    torch.manual_seed(0)
    return ScalarGainModel()


def _sgd(params):
    return torch.optim.SGD(params, lr=LR)


def _derived(p) -> dict:
    """Tensors derived from a parameter (a DTensor or, in the reference, a plain tensor), as full tensors."""
    full = (lambda t: t.full_tensor()) if hasattr(p, "full_tensor") else (lambda t: t)
    value = p.detach()
    result = {"clone": full(value.clone()), "times_two": full(value * 2)}
    if value.dim():
        result["first_row"] = full(value[0]) if value.shape[0] else None
        result["last_dim_sum"] = full(value.sum(dim=-1))
        result["dim0_sum"] = full(value.sum(dim=0))
    return {k: v.clone() for k, v in result.items() if v is not None}


def _reference():
    """Single-process SGD with torch's clip_grad_norm_ and an EMA of the weights; per-step values."""
    model = _make_model()
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
                      "params": {name: p.detach().clone() for name, p in params.items()},
                      "derived": {name: _derived(p) for name, p in params.items()},
                      "ema": {name: value.clone() for name, value in ema.items()}})
    return steps


def _resting_behaviour():
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import megatron_fsdp
    from megatron_fsdp.layout import chunk_rows

    rank, world = dist.get_rank(), dist.get_world_size()
    results = {"steps": []}
    unwrapped = _make_model()
    initial = {name: p.detach().clone() for name, p in unwrapped.named_parameters(remove_duplicate=False)}
    model = megatron_fsdp.fully_shard_model(unwrapped, fsdp_unit_modules=[models.Block], zero_dp_strategy=3)
    # Built after wrapping, from the DTensors the module shows now.
    optimizer = megatron_fsdp.fully_shard_optimizer(_sgd([p for p in model.parameters() if p.requires_grad]))

    params = dict(model.module.named_parameters(remove_duplicate=False))
    results["all_dtensors"] = all(isinstance(p, DTensor) and isinstance(p, nn.Parameter) for p in params.values())
    results["placements"] = {name: tuple(p.placements) for name, p in params.items()}
    results["device"] = str(next(model.parameters()).device)
    results["shapes"] = {name: tuple(p.shape) for name, p in params.items()}
    results["tied_is_one_parameter"] = model.module.body.inp.weight is model.module.body.blocks[0].fc2.weight
    results["initial_full_equal"] = all(torch.equal(p.full_tensor(), initial[name]) for name, p in params.items())
    # this rank's rows, exactly where chunk_rows says, as views of the compute shard (zero-copy)
    results["local_rows"] = all(
        torch.equal(p.to_local(), initial[name][slice(*chunk_rows(p.shape[0], world, rank))])
        for name, p in params.items() if p.dim())
    views = []
    for name, p in params.items():
        group, _ = model.param_to_group[id(p)]
        views.append(p.to_local().untyped_storage().data_ptr() == group.compute_shard.untyped_storage().data_ptr())
    results["views_shard"] = all(views)
    results["redistributed"] = {name: p.detach().redistribute(placements=[Replicate()]).to_local().clone()
                                for name, p in params.items()}

    ema = {name: p.detach().clone() for name, p in params.items()}
    for inputs, target in models.make_batches(NUM_STEPS):
        inputs, target = models.local_slice(inputs, rank, world), models.local_slice(target, rank, world)
        optimizer.zero_grad()
        results["grads_none_after_zero_grad"] = all(p.grad is None for p in model.parameters())
        models.loss_fn(model(inputs), target).backward()
        params = dict(model.module.named_parameters(remove_duplicate=False))
        step = {"grads": {name: p.grad.full_tensor().clone() for name, p in params.items() if p.grad is not None},
                "grad_placements": {tuple(p.grad.placements) for p in params.values()
                                    if p.grad is not None and p.dim()},
                "grad_local_rows": all(p.grad.to_local().shape == p.to_local().shape
                                       for p in params.values() if p.grad is not None)}
        step["clip_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).full_tensor())
        optimizer.step()
        step["params"] = {name: p.detach().full_tensor().clone() for name, p in params.items()}
        step["derived"] = {name: _derived(p) for name, p in params.items()}
        for name, p in params.items():
            ema[name].lerp_(p.detach(), EMA_WEIGHT)
        step["ema"] = {name: value.full_tensor().clone() for name, value in ema.items()}
        results["steps"].append(step)
    results["shard_placement"] = Shard(0)

    with torch.no_grad():
        model(inputs)
    results["dtensors_after_eval"] = all(isinstance(p, DTensor) for p in model.module.parameters())
    with model.gathered_parameters() as module:
        results["real_inside"] = not any(isinstance(p, DTensor) for p in module.parameters())
        results["gathered"] = {name: p.detach().clone() for name, p in module.named_parameters(remove_duplicate=False)}
    results["dtensors_after_exit"] = all(isinstance(p, DTensor) for p in model.module.parameters())
    results["state_dict"] = models.full_params(model)
    return results


def _close(got, want, name):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("world_size", [2, 3])
def test_strategy3_parameters_at_rest_are_shard0_dtensors_of_this_ranks_rows(world_size):
    reference = _reference()
    plain = dict(_make_model().named_parameters(remove_duplicate=False))
    for rank_result in run_on_ranks(world_size, _resting_behaviour):
        assert rank_result["all_dtensors"] and rank_result["device"] == "cpu"
        shard = rank_result["shard_placement"]
        for name, placements in rank_result["placements"].items():
            assert placements == ((shard,) if plain[name].dim() else placements) and len(placements) == 1, name
        assert rank_result["shapes"] == {name: tuple(p.shape) for name, p in plain.items()}
        assert rank_result["tied_is_one_parameter"] and rank_result["initial_full_equal"]
        assert rank_result["local_rows"] and rank_result["views_shard"]
        for name, value in rank_result["redistributed"].items():
            assert torch.equal(value, plain[name].detach()), name
        assert rank_result["grads_none_after_zero_grad"]
        for got, expected in zip(rank_result["steps"], reference):
            assert got["grad_placements"] == {(shard,)} and got["grad_local_rows"]
            assert set(got["grads"]) == set(expected["grads"])
            for name, grad in expected["grads"].items():
                _close(got["grads"][name], grad, name)
            assert got["clip_norm"] == pytest.approx(expected["clip_norm"], rel=1e-5)
            for name, value in expected["params"].items():
                _close(got["params"][name], value, name)
                _close(got["ema"][name], expected["ema"][name], name)  # an EMA derived from the DTensors
                assert got["derived"][name].keys() == expected["derived"][name].keys(), name
                for kind, derived in expected["derived"][name].items():
                    _close(got["derived"][name][kind], derived, f"{name} {kind}")
        assert rank_result["dtensors_after_eval"] and rank_result["real_inside"] and rank_result["dtensors_after_exit"]
        gathered = rank_result["gathered"]
        assert set(gathered) == set(reference[-1]["params"])
        for name, value in reference[-1]["params"].items():
            _close(gathered[name], value, name)
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


HOOK_STEPS = 3


def _losses_with_a_hook_in_the_first_step(parameters, train_step, hooked=True):
    """Losses of HOOK_STEPS steps, the output layer's gradient zeroed by a hook on it in the first step only."""
    handle = parameters["out.weight"].register_hook(lambda grad: grad * 0.0) if hooked else None
    losses = []
    for step, batch in enumerate(models.make_batches(HOOK_STEPS)):
        if step == 1 and handle is not None:
            handle.remove()
        losses.append(train_step(batch))
    return losses


def _reference_hooked_losses(hooked=True):
    module = models.make_model(0)
    optimizer = models.make_optimizer([p for p in module.parameters() if p.requires_grad])

    def train_step(batch):
        inputs, target = batch
        optimizer.zero_grad()
        loss = models.loss_fn(module(inputs), target)
        loss.backward()
        optimizer.step()
        return loss.item()

    return _losses_with_a_hook_in_the_first_step(dict(module.named_parameters()), train_step, hooked)


def _hooked_losses(strategy):
    import torch.distributed as dist

    import megatron_fsdp

    module = models.make_model(0)
    model, optimizer = megatron_fsdp.fully_shard(
        module, models.make_optimizer([p for p in module.parameters() if p.requires_grad]),
        fsdp_unit_modules=[models.Block], zero_dp_strategy=strategy)

    def train_step(batch):
        inputs, target = (models.local_slice(t, dist.get_rank(), dist.get_world_size()) for t in batch)
        optimizer.zero_grad()
        loss = models.loss_fn(model(inputs), target)
        loss.backward()
        optimizer.step()
        return models.global_mean(loss.item())

    losses = _losses_with_a_hook_in_the_first_step(dict(model.module.named_parameters()), train_step)
    model.module.out.bias.register_post_accumulate_grad_hook(lambda param: None)
    try:
        model(torch.zeros(1, models.IN_FEATURES))
        post_accumulate_error = None
    except ValueError as error:
        post_accumulate_error = str(error)
    return losses, post_accumulate_error


@pytest.mark.parametrize("world_size", [2])
def test_gradient_hooks_registered_after_wrapping_act_like_torch(world_size):
    reference = _reference_hooked_losses()
    assert abs(reference[1] - _reference_hooked_losses(hooked=False)[1]) > 1e-4  # the hook changes the next loss
    for strategy in (1, 3):
        for losses, post_accumulate_error in run_on_ranks(world_size, _hooked_losses, strategy):
            assert losses == pytest.approx(reference, rel=1e-5, abs=1e-6), strategy
            if strategy == 3:
                assert post_accumulate_error is not None and "'out.bias'" in post_accumulate_error, strategy
                assert "register_hook(fn)" in post_accumulate_error, post_accumulate_error
            else:
                assert post_accumulate_error is None, post_accumulate_error

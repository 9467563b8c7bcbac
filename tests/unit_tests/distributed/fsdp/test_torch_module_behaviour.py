"""A wrapped model behaves like the torch module it wraps in user code: its state dict has the module's keys (tied
aliases included) and loads a plain module's state dict strictly; `optimizer.step(closure)` trains; `model.zero_grad()`
clears the step's gradients as `optimizer.zero_grad()` does; right after
`optimizer.step()` the weights read inside `gathered_parameters()` or broadcast by `broadcast_params()` are the
updated ones (no all-gather left in flight)."""

import pytest
import torch

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS = 2
TIED_ALIAS = "blocks.0.fc2.weight"  # TinyModel ties it to inp.weight


def _wrap(strategy, seed=0):
    import megatron_fsdp

    module = models.make_model(seed)
    optimizer = models.make_optimizer([p for p in module.parameters() if p.requires_grad])
    return megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[models.Block], zero_dp_strategy=strategy)


def _full(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _state_dict_checks(strategy):
    results = {}
    plain = models.make_model(0)
    model, _ = _wrap(strategy)
    state = model.state_dict()
    results["keys"] = list(state)
    results["plain_keys"] = list(plain.state_dict())
    results["values_equal"] = all(torch.equal(_full(state[key]), value) for key, value in plain.state_dict().items())
    results["alias_is_same_tensor"] = state[TIED_ALIAS] is state["inp.weight"]

    other = models.make_model(7)  # a plain module with other weights: load its state dict strictly
    incompatible = model.load_state_dict(other.state_dict(), strict=True)
    results["incompatible"] = (list(incompatible.missing_keys), list(incompatible.unexpected_keys))
    reloaded = model.state_dict()
    results["loaded_equal"] = all(torch.equal(_full(reloaded[key]), value) for key, value in other.state_dict().items())
    # Only the alias given: the tied parameter still loads; a key the module lacks is still reported.
    only_alias = {k: v for k, v in plain.state_dict().items() if k != "inp.weight"}
    model.load_state_dict(only_alias, strict=True)
    results["alias_only_loaded"] = torch.equal(_full(model.state_dict()["inp.weight"]), plain.inp.weight)
    try:
        model.load_state_dict({**plain.state_dict(), "nonexistent.weight": torch.zeros(1)}, strict=True)
        results["unexpected_error"] = None
    except RuntimeError as error:
        results["unexpected_error"] = str(error)
    return results


@pytest.mark.parametrize("world_size", [2])
def test_state_dict_keys_match_module_and_plain_state_dict_loads_strictly(world_size):
    for strategy in (1, 3):
        for rank_result in run_on_ranks(world_size, _state_dict_checks, strategy):
            assert rank_result["keys"] == rank_result["plain_keys"], strategy
            assert TIED_ALIAS in rank_result["keys"]
            assert rank_result["values_equal"] and rank_result["alias_is_same_tensor"], strategy
            assert rank_result["incompatible"] == ([], []), strategy
            assert rank_result["loaded_equal"] and rank_result["alias_only_loaded"], strategy
            assert "nonexistent.weight" in rank_result["unexpected_error"], strategy


def _train_with_closure(strategy):
    import torch.distributed as dist

    model, optimizer = _wrap(strategy)
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = models.make_batches(NUM_STEPS + 1)
    losses = []
    for step in range(NUM_STEPS + 1):
        inputs, target = (models.local_slice(t, rank, world) for t in batches[step])
        if step == NUM_STEPS:
            with torch.no_grad():
                losses.append(models.global_mean(models.loss_fn(model(inputs), target).item()))
            break

        def closure():
            optimizer.zero_grad()
            loss = models.loss_fn(model(inputs), target)
            loss.backward()
            return loss

        losses.append(models.global_mean(optimizer.step(closure).item()))
    return losses


@pytest.mark.parametrize("world_size", [2])
def test_optimizer_step_with_closure_trains_like_the_reference(world_size):
    reference, _ = models.reference_losses(NUM_STEPS)
    for strategy in (0, 1, 2, 3):
        for losses in run_on_ranks(world_size, _train_with_closure, strategy):
            assert losses == pytest.approx(reference, abs=1e-5), strategy


def _weights_right_after_step(strategy):
    import torch.distributed as dist

    results = {}
    model, optimizer = _wrap(strategy)
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs, target = (models.local_slice(t, rank, world) for t in models.make_batches(1)[0])
    for check in ("gathered_parameters", "broadcast_params"):
        optimizer.zero_grad()
        models.loss_fn(model(inputs), target).backward()
        optimizer.step()
        if check == "gathered_parameters":
            with model.gathered_parameters() as module:
                results["in_flight_inside"] = len(model.schedule.pending_gathers)
                results["gathered"] = {name: p.detach().clone() for name, p in module.named_parameters()}
        else:
            model.broadcast_params()
            results["in_flight_after_broadcast"] = len(model.schedule.pending_gathers)
            results["broadcast"] = {name: p.detach().clone() for name, p in model.module.named_parameters()}
    return results


def _reference_params_after_same_batch_twice():
    module = models.make_model(0)
    optimizer = models.make_optimizer([p for p in module.parameters() if p.requires_grad])
    inputs, target = models.make_batches(1)[0]
    snapshots = []
    for _ in range(2):
        optimizer.zero_grad()
        models.loss_fn(module(inputs), target).backward()
        optimizer.step()
        snapshots.append({name: p.detach().clone() for name, p in module.named_parameters()})
    return snapshots


@pytest.mark.parametrize("world_size", [2])
def test_weights_read_right_after_step_are_the_updated_ones(world_size):
    after_first, after_second = _reference_params_after_same_batch_twice()
    for strategy in (1, 2):
        for rank_result in run_on_ranks(world_size, _weights_right_after_step, strategy):
            assert rank_result["in_flight_inside"] == 0 and rank_result["in_flight_after_broadcast"] == 0
            for observed, expected in ((rank_result["gathered"], after_first), (rank_result["broadcast"], after_second)):
                assert set(observed) == set(expected)
                for name, value in expected.items():
                    torch.testing.assert_close(observed[name], value, rtol=0, atol=1e-6, msg=name)


def _train_with_module_zero_grad(strategy):
    """The torch loop that clears gradients through the model (`model.zero_grad()`) rather than the optimizer."""
    import torch.distributed as dist

    model, optimizer = _wrap(strategy)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step, batch in enumerate(models.make_batches(NUM_STEPS + 2)):
        inputs, target = (models.local_slice(t, rank, world) for t in batch)
        model.zero_grad()
        loss = models.loss_fn(model(inputs), target)
        losses.append(models.global_mean(loss.item()))
        if step == NUM_STEPS + 1:
            break
        loss.backward()
        optimizer.step()
    return losses


@pytest.mark.parametrize("world_size", [3])
def test_module_zero_grad_clears_the_step_gradients(world_size):
    reference, _ = models.reference_losses(NUM_STEPS + 1)
    for strategy in (0, 1, 2, 3):
        for losses in run_on_ranks(world_size, _train_with_module_zero_grad, strategy):
            assert losses == pytest.approx(reference, abs=1e-5), strategy


def _call_the_inner_module(strategy):
    model, _ = _wrap(strategy)
    inputs = models.make_batches(1)[0][0]
    try:
        model.module(inputs)
        direct = "ran"
    except RuntimeError as error:
        direct = str(error)
    with model.gathered_parameters() as module:
        gathered_output = module(inputs).detach().clone()
    return {"direct": direct, "gathered_output": gathered_output, "wrapper_output": model(inputs).detach().clone()}


@pytest.mark.parametrize("world_size", [2])
def test_calling_the_inner_module_directly_under_zero3_names_the_wrapper(world_size):
    expected = models.make_model(0)(models.make_batches(1)[0][0]).detach()
    for strategy in (1, 3):
        for rank_result in run_on_ranks(world_size, _call_the_inner_module, strategy):
            if strategy == 3:
                assert "call the wrapper instead (`model(...)`" in rank_result["direct"]
                assert "gathered_parameters()" in rank_result["direct"]
            else:
                assert rank_result["direct"] == "ran"  # full weights at rest: the inner module runs as it is
            torch.testing.assert_close(rank_result["gathered_output"], expected, rtol=0, atol=0)
            torch.testing.assert_close(rank_result["wrapper_output"], expected, rtol=0, atol=0)

"""Habits of a plain torch training loop that carry over to a wrapped model: torch.distributed.checkpoint's
`get_model_state_dict` / `set_model_state_dict` with `full_state_dict=True` (export to, and load from, an
unwrapped module; `ignore_frozen_params=True` leaves out the frozen parameters' keys), `optimizer.add_param_group`
with more of the model's parameters mid-training, two optimizers over disjoint parameters of one model, each
stepped and cleared in turn, `load_state_dict(partial, strict=False)` (a backbone checkpoint into a model with a
new head), and a wrapped model held as a child of a plain module, whose `state_dict()` / `load_state_dict()` (and
torch's `get_model_state_dict`) go through the parent."""

import pytest
import torch
import torch.nn as nn

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS = 3
ADDED_LR = 3e-2  # the added group's own learning rate (the others use make_optimizer's 1e-2)


def _wrap(module, optimizer, strategy):
    import megatron_fsdp

    return megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[models.Block], zero_dp_strategy=strategy)


def _full_state_dict_round_trip(strategy):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    full = StateDictOptions(full_state_dict=True)
    module = models.make_model(0)
    model, _ = _wrap(module, models.make_optimizer([p for p in module.parameters() if p.requires_grad]), strategy)
    exported = get_model_state_dict(model, options=full)
    trainable_only = get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=True))
    sharded_trainable = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    plain = models.make_model(5)
    exported_loads = plain.load_state_dict(exported, strict=True)
    incompatible = set_model_state_dict(model, models.make_model(7).state_dict(), options=full)
    return {
        "keys": list(exported),
        "trainable_only": {name: value.clone() for name, value in trainable_only.items()},
        "sharded_trainable_keys": list(sharded_trainable),
        "exported_loads": (list(exported_loads.missing_keys), list(exported_loads.unexpected_keys)),
        "exported_plain": {name: value.clone() for name, value in plain.state_dict().items()},
        "set_incompatible": (list(incompatible.missing_keys), list(incompatible.unexpected_keys)),
        "after_set": {name: value.clone() for name, value in get_model_state_dict(model, options=full).items()},
    }


@pytest.mark.parametrize("world_size", [3])
def test_full_state_dict_exports_to_and_loads_from_an_unwrapped_module(world_size):
    initial, other = models.make_model(0).state_dict(), models.make_model(7).state_dict()
    # ignore_frozen_params: the unwrapped module's keys less the frozen layer's, as torch gives them
    trainable = [name for name in initial if not name.startswith("frozen.")]
    for strategy in (0, 1, 2, 3):
        for rank, rank_result in enumerate(run_on_ranks(world_size, _full_state_dict_round_trip, strategy)):
            assert rank_result["keys"] == list(initial), strategy
            assert rank_result["sharded_trainable_keys"] == trainable, strategy
            # cpu_offload with full_state_dict: rank 0 holds the full tensors, the other ranks nothing
            assert list(rank_result["trainable_only"]) == (trainable if rank == 0 else []), strategy
            for name, value in rank_result["trainable_only"].items():
                assert torch.equal(value, initial[name]), (strategy, name)
            assert rank_result["exported_loads"] == ([], []), strategy
            assert rank_result["set_incompatible"] == ([], []), strategy
            for name in initial:
                assert torch.equal(rank_result["exported_plain"][name], initial[name]), (strategy, name)
                assert torch.equal(rank_result["after_set"][name], other[name]), (strategy, name)


def _param_groups(module):
    """All trainable parameters but the output layer's, which join the optimizer after the first step."""
    first = [p for name, p in module.named_parameters() if p.requires_grad and not name.startswith("out.")]
    return first, list(module.out.parameters())


def _reference_losses_with_added_group():
    module = models.make_model(0)
    first, added = _param_groups(module)
    optimizer = models.make_optimizer(first)
    losses = []
    for step, (inputs, target) in enumerate(models.make_batches(NUM_STEPS)):
        if step == 1:
            optimizer.add_param_group({"params": added, "lr": ADDED_LR})
        optimizer.zero_grad()
        loss = models.loss_fn(module(inputs), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _train_with_added_group(strategy):
    import torch.distributed as dist

    module = models.make_model(0)
    first, _ = _param_groups(module)
    model, optimizer = _wrap(module, models.make_optimizer(first), strategy)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step, batch in enumerate(models.make_batches(NUM_STEPS)):
        if step == 1:  # the wrapped module's parameters, as a user holding `model` reaches them
            optimizer.add_param_group({"params": model.module.out.parameters(), "lr": ADDED_LR})
        inputs, target = (models.local_slice(t, rank, world) for t in batch)
        optimizer.zero_grad()
        loss = models.loss_fn(model(inputs), target)
        loss.backward()
        optimizer.step()
        losses.append(models.global_mean(loss.item()))
    try:
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
        foreign_error = None
    except ValueError as error:
        foreign_error = str(error)
    return {"losses": losses, "group_names": optimizer.state_dict()["param_groups"][-1]["params"],
            "foreign_error": foreign_error}


@pytest.mark.parametrize("world_size", [2])
def test_add_param_group_with_model_parameters_trains_like_torch(world_size):
    reference = _reference_losses_with_added_group()
    for strategy in (0, 1, 2, 3):
        for rank_result in run_on_ranks(world_size, _train_with_added_group, strategy):
            assert rank_result["losses"] == pytest.approx(reference, abs=1e-5), strategy
            assert rank_result["group_names"] == ["out.weight", "out.bias"], strategy
            assert "not part of its MegatronFSDP model" in rank_result["foreign_error"], strategy


def _torch_optimizer_state_dict_helpers():
    from torch.distributed.checkpoint import state_dict as torch_state_dict

    module = models.make_model(0)
    model, optimizer = _wrap(module, models.make_optimizer([p for p in module.parameters() if p.requires_grad]), 3)
    own = optimizer.state_dict()
    calls = {
        "get_optimizer_state_dict": lambda: torch_state_dict.get_optimizer_state_dict(model, optimizer),
        "get_state_dict": lambda: torch_state_dict.get_state_dict(model, optimizer),
        "set_optimizer_state_dict": lambda: torch_state_dict.set_optimizer_state_dict(model, optimizer, own),
        "set_state_dict": lambda: torch_state_dict.set_state_dict(
            model, optimizer, model_state_dict=model.state_dict(), optim_state_dict=own),
    }
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except Exception as error:  # noqa: BLE001 -- the type is part of what the test checks
            errors[name] = (type(error).__name__, str(error))
    errors["own_state_dict_keys"] = sorted(optimizer.state_dict()["state"])[:1]
    optimizer.load_state_dict(own)  # the index-keyed form goes through torch's own load, which replaces .state
    optimizer._megatron_fsdp_original_load_state_dict(optimizer._megatron_fsdp_original_state_dict())
    try:
        torch_state_dict.set_optimizer_state_dict(model, optimizer, own)
        errors["set_after_reload"] = None
    except RuntimeError as error:
        errors["set_after_reload"] = str(error)
    return errors


@pytest.mark.parametrize("world_size", [2])
def test_torch_optimizer_state_dict_helpers_refuse_and_name_the_replacement(world_size):
    """get_optimizer_state_dict / get_state_dict / set_optimizer_state_dict / set_state_dict(model, optimizer)
    cannot map the sharded optimizer's state to parameter names; they raise an error naming optimizer.state_dict()
    (which already is that form) instead of torch's KeyError on the first parameter name (the set helpers: on a
    main-weight tensor, printed whole), also after torch's own load_state_dict replaced `optimizer.state`. The
    optimizer's own state dict still works afterwards."""
    for errors in run_on_ranks(world_size, _torch_optimizer_state_dict_helpers):
        for name in ("get_optimizer_state_dict", "get_state_dict", "set_optimizer_state_dict", "set_state_dict"):
            kind, message = errors[name]
            assert kind == "RuntimeError", (name, kind, message)
            assert "optimizer.state_dict()" in message and "optimizer.load_state_dict()" in message
        assert "optimizer.load_state_dict()" in errors["set_after_reload"]
        assert errors["own_state_dict_keys"] == ["blocks.0.fc1.bias"]


def _split_for_two_optimizers(module):
    """AdamW over every trainable parameter but the output layer's, SGD over the output layer."""
    first, head = _param_groups(module)
    return models.make_optimizer(first), torch.optim.SGD(head, lr=0.1)


def _step_then_zero_each(model, optimizers, inputs, target):
    loss = models.loss_fn(model(inputs), target)
    loss.backward()
    for optimizer in optimizers:  # torch clears only an optimizer's own parameters: the next one still steps
        optimizer.step()
        optimizer.zero_grad()
    return loss


def _reference_losses_with_two_optimizers():
    module = models.make_model(0)
    optimizers = _split_for_two_optimizers(module)
    return [_step_then_zero_each(module, optimizers, *batch).item() for batch in models.make_batches(NUM_STEPS)]


def _train_with_two_optimizers(strategy):
    import megatron_fsdp
    import torch.distributed as dist

    model = megatron_fsdp.fully_shard_model(models.make_model(0), fsdp_unit_modules=[models.Block],
                                            zero_dp_strategy=strategy)
    optimizers = [megatron_fsdp.fully_shard_optimizer(o) for o in _split_for_two_optimizers(model.module)]
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for batch in models.make_batches(NUM_STEPS):
        inputs, target = (models.local_slice(t, rank, world) for t in batch)
        losses.append(models.global_mean(_step_then_zero_each(model, optimizers, inputs, target).item()))
    # One optimizer cleared, the other not: the shared buffers can neither keep nor drop the gradients.
    optimizers[0].zero_grad()
    try:
        models.loss_fn(model(inputs), target).backward()
        partial_error = None
    except RuntimeError as error:
        partial_error = str(error)
    return {"losses": losses, "partial_error": partial_error}


@pytest.mark.parametrize("world_size", [2])
def test_two_optimizers_over_one_model_step_and_clear_in_turn_like_torch(world_size):
    """`opt_a.step(); opt_a.zero_grad(); opt_b.step(); opt_b.zero_grad()` over disjoint parameters of one model:
    opt_a's zero_grad() must not clear the gradients opt_b is about to step with (the buffers are shared)."""
    reference = _reference_losses_with_two_optimizers()
    for strategy in (0, 1, 2, 3):
        for rank_result in run_on_ranks(world_size, _train_with_two_optimizers, strategy):
            assert rank_result["losses"] == pytest.approx(reference, abs=1e-5), strategy
            error = rank_result["partial_error"]
            assert error is not None and "zero_grad() of AdamW(" in error and "but not of SGD(out.weight" in error
            assert "model.zero_grad()" in error, strategy


def _checkpoint_wrapped(seed):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    module = models.make_model(seed)
    apply_activation_checkpointing(module, check_fn=lambda submodule: isinstance(submodule, models.Block))
    return module


def _checkpoint_wrapper_state_dicts(strategy):
    module = _checkpoint_wrapped(0)
    model, optimizer = _wrap(module, models.make_optimizer([p for p in module.parameters() if p.requires_grad]),
                             strategy)
    inputs, target = (models.local_slice(t, *_rank_and_world()) for t in models.make_batches(1)[0])
    models.loss_fn(model(inputs), target).backward()
    optimizer.step()
    saved = optimizer.state_dict()
    exp_avg = {name: state["exp_avg"].full_tensor() for name, state in saved["state"].items()}
    for state in optimizer.state.values():
        state["exp_avg"].zero_()
    optimizer.load_state_dict(saved)
    reloaded = {name: state["exp_avg"].full_tensor() for name, state in optimizer.state_dict()["state"].items()}
    other = _checkpoint_wrapped(7)
    incompatible = model.load_state_dict(other.state_dict(), strict=True)
    return {
        "model_keys": list(model.state_dict()),
        "optimizer_keys": sorted(saved["state"]),
        "group_names": saved["param_groups"][0]["params"],
        "exp_avg_round_trip": all(torch.equal(exp_avg[name], reloaded[name]) for name in exp_avg),
        "exp_avg_nonzero": all(value.abs().sum() > 0 for name, value in exp_avg.items() if "blocks.1" in name),
        "incompatible": (list(incompatible.missing_keys), list(incompatible.unexpected_keys)),
        "after_load": {name: value.full_tensor().clone() for name, value in model.state_dict().items()
                       if hasattr(value, "full_tensor")},
    }


def _rank_and_world():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


@pytest.mark.parametrize("world_size", [2])
def test_checkpoint_wrapper_keys_match_the_unwrapped_module(world_size):
    """Blocks wrapped by torch's checkpoint_wrapper: a plain module's state dict leaves out the wrapper's
    `_checkpoint_wrapped_module.` (and so do FSDP2 and torch.distributed.checkpoint), so the wrapped model's model
    and optimizer state dicts do too, and a plain module's state dict loads strictly."""
    plain = _checkpoint_wrapped(7).state_dict()
    assert not any("_checkpoint_wrapped_module" in key for key in plain)
    trainable = [name for name, p in _checkpoint_wrapped(0).named_parameters() if p.requires_grad]
    expected_optimizer_keys = sorted(name.replace("_checkpoint_wrapped_module.", "") for name in trainable)
    for strategy in (1, 3):
        for rank_result in run_on_ranks(world_size, _checkpoint_wrapper_state_dicts, strategy):
            assert rank_result["model_keys"] == list(plain), strategy
            assert rank_result["optimizer_keys"] == expected_optimizer_keys, strategy
            assert rank_result["group_names"][:2] == ["inp.weight", "inp.bias"], strategy
            assert "blocks.1.fc1.weight" in rank_result["group_names"], strategy
            assert rank_result["exp_avg_nonzero"] and rank_result["exp_avg_round_trip"], strategy
            assert rank_result["incompatible"] == ([], []), strategy
            for name, value in rank_result["after_load"].items():
                assert torch.equal(value, plain[name]), (strategy, name)


def _full_values(state):
    return {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()
            for name, value in state.items()}


def _partial_load(strategy):
    module = models.make_model(0)
    model, _ = _wrap(module, models.make_optimizer([p for p in module.parameters() if p.requires_grad]), strategy)
    partial = models.make_model(7).state_dict()
    del partial["out.bias"]
    partial["extra.weight"] = torch.zeros(1)
    incompatible = model.load_state_dict(partial, strict=False)
    return {"incompatible": (list(incompatible.missing_keys), list(incompatible.unexpected_keys)),
            "after": _full_values(model.state_dict())}


@pytest.mark.parametrize("world_size", [2])
def test_load_state_dict_with_strict_false_loads_every_key_it_is_given(world_size):
    """`out.bias` is missing: it keeps its value, and every other entry (out.weight, in the same parameter group
    as out.bias, included) takes the dict's, as `nn.Module.load_state_dict(strict=False)` does."""
    initial, loaded = models.make_model(0).state_dict(), models.make_model(7).state_dict()
    for strategy in (0, 1, 2, 3):
        for rank_result in run_on_ranks(world_size, _partial_load, strategy):
            assert rank_result["incompatible"] == (["out.bias"], ["extra.weight"]), strategy
            for name, value in rank_result["after"].items():
                assert torch.equal(value, (initial if name == "out.bias" else loaded)[name]), (strategy, name)


class _Parent(nn.Module):
    """A plain module holding the model to shard as a child, next to a head of its own."""

    def __init__(self, seed):
        super().__init__()
        self.net = models.make_model(seed)
        torch.manual_seed(seed + 1)
        self.head = nn.Linear(models.IN_FEATURES, 2)


def _wrapped_as_a_child(strategy):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import megatron_fsdp

    parent = _Parent(0)
    parent.net = megatron_fsdp.fully_shard_model(parent.net, fsdp_unit_modules=[models.Block],
                                                 zero_dp_strategy=strategy)
    saved = _full_values(parent.state_dict())
    trainable_keys = list(get_model_state_dict(parent, options=StateDictOptions(ignore_frozen_params=True)))
    incompatible = parent.load_state_dict(_Parent(7).state_dict())
    after = _full_values(parent.state_dict())
    lacking = _Parent(9).state_dict()
    del lacking["net.out.bias"]
    try:
        parent.load_state_dict(lacking)
        strict_error = None
    except RuntimeError as error:
        strict_error = str(error)
    return {"saved": saved, "incompatible": (list(incompatible.missing_keys), list(incompatible.unexpected_keys)),
            "after": after, "strict_error": strict_error, "trainable_keys": trainable_keys}


@pytest.mark.parametrize("world_size", [2])
def test_a_model_wrapped_as_a_child_saves_and_loads_through_its_parent(world_size):
    """The parent's `state_dict()` has the unwrapped parent's keys and values (the child's under `net.`, no
    `module.`), and the parent's `load_state_dict()` loads a plain parent's state dict into the shards, strictly,
    naming a missing key as the unwrapped parent would."""
    initial, loaded = _Parent(0).state_dict(), _Parent(7).state_dict()
    for strategy in (0, 3):
        for rank_result in run_on_ranks(world_size, _wrapped_as_a_child, strategy):
            assert list(rank_result["saved"]) == list(initial), strategy
            # get_model_state_dict(parent, ignore_frozen_params=True): the unwrapped parent's keys less the frozen
            assert rank_result["trainable_keys"] == [key for key in initial if not key.startswith("net.frozen.")]
            assert rank_result["incompatible"] == ([], []), strategy
            for name in initial:
                assert torch.equal(rank_result["saved"][name], initial[name]), (strategy, name)
                assert torch.equal(rank_result["after"][name], loaded[name]), (strategy, name)
            error = rank_result["strict_error"]
            assert error is not None and '"net.out.bias"' in error and "net.module." not in error, error

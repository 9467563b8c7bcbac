"""torch.optim optimizers other than AdamW in a plain torch loop over a wrapped model.

* Adagrad, whose constructor creates its state (a step count of 0), is taken by `fully_shard` and trains like
  torch.
* A fresh optimizer's `state_dict()` holds every state a trained one's does (SGD's momentum buffers, RMSprop's
  averages, ...), so `dcp.load` into it restores them and a resumed run continues its momentum.
* `torch.amp.GradScaler` is refused with a message naming bf16 and `scale_gradients`, and a plain
  `optimizer.step()` still works afterwards.
"""

import pytest
import torch

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS = 2

OPTIMIZERS = {
    "sgd_nesterov": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True),
    "rmsprop_centered": lambda params: torch.optim.RMSprop(params, lr=1e-2, momentum=0.5, centered=True),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.05, initial_accumulator_value=0.1),
    "nadam": lambda params: torch.optim.NAdam(params, lr=1e-2),
}


def _trainable(module):
    return [p for p in module.parameters() if p.requires_grad]


def _wrap(optimizer_name, strategy, seed=0):
    import megatron_fsdp

    module = models.make_model(seed)
    return megatron_fsdp.fully_shard(module, OPTIMIZERS[optimizer_name](_trainable(module)),
                                     fsdp_unit_modules=[models.Block], zero_dp_strategy=strategy)


def _train(model, optimizer, batches):
    import torch.distributed as dist

    losses = []
    for batch in batches:
        inputs, target = (models.local_slice(t, dist.get_rank(), dist.get_world_size()) for t in batch)
        optimizer.zero_grad()
        loss = models.loss_fn(model(inputs), target)
        loss.backward()
        optimizer.step()
        losses.append(models.global_mean(loss.item()))
    return losses


def _reference_losses(optimizer_name, batches):
    module = models.make_model(0)
    optimizer = OPTIMIZERS[optimizer_name](_trainable(module))
    losses = []
    for inputs, target in batches:
        optimizer.zero_grad()
        loss = models.loss_fn(module(inputs), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _state_keys(optimizer):
    return {name: sorted(state) for name, state in optimizer.state_dict()["state"].items()}


def _resume_through_dcp(optimizer_name, strategy, checkpoint_dir):
    """Train, save model and optimizer with dcp, load into a fresh wrapped model and optimizer (dcp.load into
    their own state dicts), and continue both; returns both continuations and the state keys."""
    import torch.distributed.checkpoint as dcp

    batches = models.make_batches(2 * NUM_STEPS)
    model, optimizer = _wrap(optimizer_name, strategy)
    first = _train(model, optimizer, batches[:NUM_STEPS])
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=checkpoint_dir)
    fresh_model, fresh_optimizer = _wrap(optimizer_name, strategy, seed=7)
    fresh_keys = _state_keys(fresh_optimizer)
    loaded = {"model": fresh_model.state_dict(), "optim": fresh_optimizer.state_dict()}
    dcp.load(loaded, checkpoint_id=checkpoint_dir)
    fresh_model.load_state_dict(loaded["model"])
    fresh_optimizer.load_state_dict(loaded["optim"])
    return {"first": first, "trained_keys": _state_keys(optimizer), "fresh_keys": fresh_keys,
            "uninterrupted": _train(model, optimizer, batches[NUM_STEPS:]),
            "resumed": _train(fresh_model, fresh_optimizer, batches[NUM_STEPS:])}


@pytest.mark.parametrize("world_size", [3])
def test_torch_optimizers_train_and_resume_through_dcp_like_torch(world_size, tmp_path):
    for optimizer_name in OPTIMIZERS:
        reference = _reference_losses(optimizer_name, models.make_batches(2 * NUM_STEPS))
        checkpoint_dir = str(tmp_path / optimizer_name)
        for result in run_on_ranks(world_size, _resume_through_dcp, optimizer_name, 3, checkpoint_dir):
            assert result["first"] + result["uninterrupted"] == pytest.approx(reference, abs=1e-5), optimizer_name
            assert result["fresh_keys"] == result["trained_keys"], optimizer_name
            assert len(result["trained_keys"]) > 0, optimizer_name
            assert result["resumed"] == pytest.approx(result["uninterrupted"], abs=1e-6), optimizer_name


def _grad_scaler_then_plain_step():
    model, optimizer = _wrap("sgd_nesterov", 3)
    inputs, target = models.make_batches(1)[0]
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    errors = []
    for explicit_unscale in (False, True):
        optimizer.zero_grad()
        scaler.scale(models.loss_fn(model(inputs), target)).backward()
        try:
            if explicit_unscale:
                scaler.unscale_(optimizer)
            scaler.step(optimizer)
            errors.append(None)
        except RuntimeError as error:
            errors.append(str(error))
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    # Without the scaler the same optimizer steps: the scaler's attributes were removed with the refusal.
    before = {name: value.full_tensor().clone() for name, value in model.state_dict().items()
              if hasattr(value, "full_tensor")}
    optimizer.zero_grad()
    models.loss_fn(model(inputs), target).backward()
    optimizer.step()
    after = {name: value.full_tensor() for name, value in model.state_dict().items() if name in before}
    return {"errors": errors, "moved": any(not torch.equal(before[name], after[name]) for name in before),
            "leftover": [name for name in ("grad_scale", "found_inf") if hasattr(optimizer, name)]}


@pytest.mark.parametrize("world_size", [2])
def test_grad_scaler_is_refused_naming_what_to_use(world_size):
    for result in run_on_ranks(world_size, _grad_scaler_then_plain_step):
        for error in result["errors"]:
            assert error is not None and error.startswith("torch.amp.GradScaler cannot drive"), error
            assert "torch.bfloat16" in error and "model.scale_gradients(1 / scale)" in error
        assert result["moved"] and result["leftover"] == []

"""Torch optimizers other than Adam and SGD through the logical checkpoint (`sharded_state_dict` with
`dist_checkpointing`): Rprop, whose state appears on its first step, resumes bit for bit; ASGD and NAdam, which
keep per-parameter scalars the checkpoint does not hold, are refused by name instead of resuming without them."""

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.optimizer import FP32Optimizer, OptimizerConfig


def _linear_with(optimizer_class, seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = FP32Optimizer(optimizer_class(model.parameters(), lr=0.01), OptimizerConfig(lr=0.01, clip_grad=0.0),
                              grad_stats_groups=[])
    optimizer.model_chunks = [model]
    return model, optimizer


def _step(model, optimizer, seed):
    generator = torch.Generator().manual_seed(seed)
    model.zero_grad()
    model(torch.randn(5, 4, generator=generator)).square().sum().backward()
    optimizer.step()


def test_rprop_state_created_on_the_first_step_is_asked_for_and_resumes_exactly(tmp_path):
    model, optimizer = _linear_with(torch.optim.Rprop, seed=0)
    for step in range(2):
        _step(model, optimizer, step)
    dist_checkpointing.save(optimizer.sharded_state_dict(), tmp_path)

    resumed_model, resumed = _linear_with(torch.optim.Rprop, seed=1)
    resumed_model.load_state_dict(model.state_dict())
    targets = resumed.sharded_state_dict(is_loading=True)
    assert {"optimizer.state.weight.prev", "optimizer.state.weight.step_size"} <= set(targets)
    assert not resumed.optimizer.state  # asking creates no state: a fresh first step stays Rprop's
    resumed.load_state_dict(dist_checkpointing.load(targets, tmp_path))
    for step in range(2, 4):
        _step(model, optimizer, step)
        _step(resumed_model, resumed, step)
    for (name, param), resumed_param in zip(model.named_parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(resumed_param, param), name


@pytest.mark.parametrize("optimizer_class, keys", [(torch.optim.ASGD, r"\['eta', 'mu'\]"),
                                                   (torch.optim.NAdam, r"\['mu_product'\]")])
def test_state_the_checkpoint_cannot_hold_is_refused_on_save_and_load(optimizer_class, keys):
    model, optimizer = _linear_with(optimizer_class, seed=0)
    _step(model, optimizer, 0)
    message = f"{optimizer_class.__name__} keeps per-parameter state {keys} .* optimizer.state_dict\\(\\)"
    with pytest.raises(ValueError, match=message):
        optimizer.sharded_state_dict()
    _, fresh = _linear_with(optimizer_class, seed=1)
    with pytest.raises(ValueError, match=message):
        fresh.sharded_state_dict(is_loading=True)
    if optimizer_class is torch.optim.ASGD:
        assert not fresh.optimizer.state  # the zeros put in for the targets are gone: its first step stays ASGD's

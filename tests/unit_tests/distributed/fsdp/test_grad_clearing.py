"""When the gradient buffers shared by several optimizers over one model are cleared (no processes needed)."""

import gc

import pytest
import torch

from megatron_fsdp.grad_clearing import GradClearing


def _optimizer(kind, *params):
    return kind([torch.nn.Parameter(p) for p in params], lr=0.1)


def test_buffers_are_due_once_every_optimizer_has_cleared():
    clearing = GradClearing()
    adamw, sgd = _optimizer(torch.optim.AdamW, torch.ones(3)), _optimizer(torch.optim.SGD, torch.ones(2))
    clearing.register(adamw)
    clearing.register(sgd)
    assert clearing.request(adamw) is False  # sgd still steps on this step's gradients
    assert clearing.request(adamw) is False
    assert clearing.request(sgd) is True
    assert clearing.check_before_backward() is False  # nothing pending after the buffers were cleared
    assert clearing.request(sgd) is False and clearing.request(adamw) is True  # either order


def test_single_optimizer_clears_at_once():
    clearing = GradClearing()
    sgd = _optimizer(torch.optim.SGD, torch.ones(2))
    clearing.register(sgd)
    assert clearing.request(sgd) is True


def test_backward_after_a_partial_clear_is_refused_naming_both_optimizers():
    clearing = GradClearing()
    adamw, sgd = _optimizer(torch.optim.AdamW, torch.ones(3)), _optimizer(torch.optim.SGD, torch.ones(2))
    sgd._megatron_fsdp_param_names = {id(sgd.param_groups[0]["params"][0]): "emb.weight"}
    clearing.register(adamw)
    clearing.register(sgd)
    clearing.request(adamw)
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) of AdamW\(\) but not of SGD\(emb.weight\)"):
        clearing.check_before_backward()
    clearing.reset()  # model.zero_grad()
    assert clearing.check_before_backward() is False


def test_a_dropped_optimizer_does_not_hold_back_the_clearing():
    clearing = GradClearing()
    kept, dropped = _optimizer(torch.optim.SGD, torch.ones(2)), _optimizer(torch.optim.SGD, torch.ones(4))
    clearing.register(kept)
    clearing.register(dropped)
    dropped.self_reference = dropped  # a cycle, as the methods fully_shard_optimizer binds to it make
    assert clearing.request(kept) is False
    del dropped
    assert clearing.check_before_backward() is True  # collected at the start of the backward
    assert len(clearing.optimizers()) == 1
    gc.collect()

"""Optimizer state created before the first step (optimizer_state.py), for the optimizers that create their own."""

import pytest
import torch

from megatron_fsdp.optimizer_state import initialize_optimizer_state


class _PerParameterInit(torch.optim.Optimizer):
    """Shaped as Transformer Engine's FusedAdam: initialize_state(param, store_param_remainders)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 1.0})
        self.calls = []

    def initialize_state(self, param, store_param_remainders):
        self.calls.append((param, store_param_remainders))
        self.state[param]["exp_avg"] = torch.zeros_like(param)


class _WholeOptimizerInit(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {"lr": 1.0})
        self.calls = 0

    def initialize_state(self):
        self.calls += 1


def test_per_parameter_initialize_state_is_called_for_each_parameter_without_state():
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    optimizer = _PerParameterInit(params)
    optimizer.state[params[1]]["exp_avg"] = torch.full((2,), 7.0)
    initialize_optimizer_state(optimizer)
    assert [(param is params[0], remainders) for param, remainders in optimizer.calls] == [(True, False)]
    assert torch.equal(optimizer.state[params[0]]["exp_avg"], torch.zeros(3))
    assert torch.equal(optimizer.state[params[1]]["exp_avg"], torch.full((2,), 7.0))


def test_whole_optimizer_initialize_state_is_called_once():
    optimizer = _WholeOptimizerInit([torch.nn.Parameter(torch.ones(3))])
    initialize_optimizer_state(optimizer)
    assert optimizer.calls == 1


def test_initialize_state_of_another_shape_is_named():
    class _Odd(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 1.0})

        def initialize_state(self, param, scale, offset):
            pass

    with pytest.raises(TypeError, match=r"_Odd.initialize_state\(param, scale, offset\)"):
        initialize_optimizer_state(_Odd([torch.nn.Parameter(torch.ones(1))]))

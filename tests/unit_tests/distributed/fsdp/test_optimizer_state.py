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


_FIRST_STEP_OPTIMIZERS = {
    "Adam(amsgrad)": lambda params: torch.optim.Adam(params, lr=0.1, amsgrad=True),
    "NAdam": lambda params: torch.optim.NAdam(params, lr=0.1),
    "RAdam": lambda params: torch.optim.RAdam(params, lr=0.1),
    "Adamax": lambda params: torch.optim.Adamax(params, lr=0.1),
    "Adadelta": lambda params: torch.optim.Adadelta(params, lr=1.0),
    "RMSprop(momentum, centered)": lambda params: torch.optim.RMSprop(params, lr=0.1, momentum=0.5, centered=True),
    "Adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1, initial_accumulator_value=0.3),
    "SGD(momentum, nesterov)": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True),
}


def _two_steps(make, initialize):
    """Parameters and state after two steps of `make`'s optimizer, its state created up front or not."""
    param = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 6))
    optimizer = make([param])
    if initialize:
        optimizer.state.clear()  # Adagrad's constructor made some: the up-front state replaces it
        initialize_optimizer_state(optimizer, sgd_momentum=True)
    before_step = {key: value.clone() for key, value in optimizer.state[param].items()}
    for target in (0.5, -0.25):
        optimizer.zero_grad()
        ((param - target) ** 2).sum().backward()
        optimizer.step()
    return param.detach().clone(), dict(optimizer.state[param]), before_step


@pytest.mark.parametrize("name", list(_FIRST_STEP_OPTIMIZERS))
def test_state_created_up_front_steps_exactly_as_torch_lazy_state(name):
    """The state is what the first step would create: the updates are bit-identical, and every key the stepped
    optimizer holds exists before the first step (so a fresh optimizer's state dict asks a checkpoint for it)."""
    make = _FIRST_STEP_OPTIMIZERS[name]
    lazy_param, lazy_state, _ = _two_steps(make, initialize=False)
    param, state, before_step = _two_steps(make, initialize=True)
    assert torch.equal(param, lazy_param), name
    assert set(before_step) == set(lazy_state) == set(state), name
    for key, value in lazy_state.items():
        assert torch.equal(state[key], value), (name, key)


def test_sgd_state_stays_lazy_with_dampening_or_without_the_flag():
    """SGD's first step sets the momentum buffer to the gradient; a zero buffer would give (1 - dampening) times
    it, so with dampening (and for callers that do not ask for SGD) no buffer is created."""
    param = torch.nn.Parameter(torch.ones(3))
    damped = torch.optim.SGD([param], lr=0.1, momentum=0.9, dampening=0.5)
    initialize_optimizer_state(damped, sgd_momentum=True)
    plain = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    initialize_optimizer_state(plain)
    assert len(damped.state) == 0 and len(plain.state) == 0

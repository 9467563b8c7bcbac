"""Optimizer state created up front: what a first step would create, without stepping."""

import inspect

import torch


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _scalar(value: float, param: torch.Tensor, param_group: dict) -> torch.Tensor:
    """A per-parameter scalar (a step count) where torch puts it: on the device when capturable or fused."""
    if param_group.get("capturable") or param_group.get("fused"):
        return torch.full((), value, dtype=torch.float32 if param_group.get("fused") else _scalar_dtype(),
                          device=param.device)
    return torch.tensor(value, dtype=_scalar_dtype())


def _zeros(param: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(param, memory_format=torch.preserve_format)


# The state torch's element-wise optimizers create on their first step, for the ones whose first step creates
# zeros (or, Adagrad, a constant) and a step count of 0 and then updates them: created up front, the first update
# is a fresh optimizer's, and a fresh optimizer's state dict already asks torch.distributed.checkpoint for every
# state a checkpoint holds. (Rprop's step sizes and ASGD's eta start at the learning rate of the first step, which a
# scheduler may still change: they stay lazy.)
_FIRST_STEP_STATE = {
    torch.optim.Adam: lambda p, g: {"exp_avg": _zeros(p), "exp_avg_sq": _zeros(p),
                                    **({"max_exp_avg_sq": _zeros(p)} if g.get("amsgrad") else {})},
    torch.optim.AdamW: lambda p, g: {"exp_avg": _zeros(p), "exp_avg_sq": _zeros(p),
                                     **({"max_exp_avg_sq": _zeros(p)} if g.get("amsgrad") else {})},
    torch.optim.NAdam: lambda p, g: {"mu_product": _scalar(1.0, p, g), "exp_avg": _zeros(p),
                                     "exp_avg_sq": _zeros(p)},
    torch.optim.RAdam: lambda p, g: {"exp_avg": _zeros(p), "exp_avg_sq": _zeros(p)},
    torch.optim.Adamax: lambda p, g: {"exp_avg": _zeros(p), "exp_inf": _zeros(p)},
    torch.optim.Adadelta: lambda p, g: {"square_avg": _zeros(p), "acc_delta": _zeros(p)},
    torch.optim.RMSprop: lambda p, g: {"square_avg": _zeros(p),
                                       **({"momentum_buffer": _zeros(p)} if g.get("momentum", 0) > 0 else {}),
                                       **({"grad_avg": _zeros(p)} if g.get("centered") else {})},
    torch.optim.Adagrad: lambda p, g: {"sum": torch.full_like(p, g["initial_accumulator_value"],
                                                              memory_format=torch.preserve_format)},
}


def _sgd_momentum_buffer(param: torch.Tensor, param_group: dict):
    """SGD's first step sets the momentum buffer to the gradient; a zero buffer gives `momentum * 0 + (1 -
    dampening) * gradient`, the same without dampening only (with it the buffer stays lazy)."""
    if param_group.get("momentum", 0) == 0 or param_group.get("dampening", 0) != 0:
        return None
    return {"momentum_buffer": _zeros(param)}


def state_records_step(state: dict) -> bool:
    """Whether a parameter's optimizer state records a step: state with a step count of 0 (Adagrad's, created by
    its constructor) is what a first step would start from, not a trace of one."""
    if not state:
        return False
    step = state.get("step")
    if isinstance(step, torch.Tensor) and step.is_meta:  # built on a meta-device model: nothing was computed
        return False
    return step is None or float(step) != 0


def optimizer_has_stepped(optimizer: torch.optim.Optimizer) -> bool:
    return any(state_records_step(state) for state in optimizer.state.values())


def initialize_optimizer_state(optimizer: torch.optim.Optimizer, sgd_momentum: bool = False):
    """Create the state of a first step without stepping, for Adam/AdamW and the torch optimizers of
    `_FIRST_STEP_STATE`: so the first real update equals a fresh optimizer's. `sgd_momentum`: also SGD's momentum
    buffers (zeros, without dampening). An optimizer with an `initialize_state()` method creates its own
    (Megatron's Muon: momentum for its matrices, Adam moments for the rest); other optimizers keep their lazy
    state."""
    initialize_state = getattr(optimizer, "initialize_state", None)
    if callable(initialize_state):
        _call_initialize_state(optimizer, initialize_state)
        return
    make_state = next((_FIRST_STEP_STATE[kind] for kind in type(optimizer).__mro__ if kind in _FIRST_STEP_STATE),
                      None)
    if make_state is None and sgd_momentum and isinstance(optimizer, torch.optim.SGD):
        make_state = _sgd_momentum_buffer
    if make_state is None:
        return
    for param_group in optimizer.param_groups:
        for param in param_group["params"]:
            state = optimizer.state[param]
            if state:
                continue
            first = make_state(param, param_group)
            if first is None:
                del optimizer.state[param]
                continue
            if make_state is not _sgd_momentum_buffer:  # SGD keeps no step count
                state["step"] = _scalar(0.0, param, param_group)
            state.update(first)


def _call_initialize_state(optimizer: torch.optim.Optimizer, initialize_state):
    """`initialize_state()` for the whole optimizer (Megatron's optimizers), or, where it takes a parameter as
    Transformer Engine's FusedAdam does (`initialize_state(param, store_param_remainders)`), once per parameter
    without state. The main weights here are fp32, so there are no bf16 remainders to store."""
    required = [p for p in inspect.signature(initialize_state).parameters.values()
                if p.default is inspect.Parameter.empty
                and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if not required:
        initialize_state()
        return
    extra = {"store_param_remainders": False} if len(required) > 1 and required[1].name == "store_param_remainders" \
        else {}
    if len(required) > 1 + len(extra):
        raise TypeError(f"{type(optimizer).__name__}.initialize_state{inspect.signature(initialize_state)}: "
                        "Megatron-FSDP creates optimizer state up front through initialize_state() or "
                        "initialize_state(param); give the optimizer one of those")
    for param_group in optimizer.param_groups:
        for param in param_group["params"]:
            if not optimizer.state[param]:
                initialize_state(param, **extra)

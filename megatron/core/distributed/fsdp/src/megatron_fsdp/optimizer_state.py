"""Optimizer state created up front: what a first step would create, without stepping."""

import inspect

import torch


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def initialize_optimizer_state(optimizer: torch.optim.Optimizer):
    """Create Adam/AdamW state as a first step would, without stepping: zero moments and a step count of 0,
    so the first real update equals a fresh optimizer's. An optimizer with an `initialize_state()` method
    creates its own (Megatron's Muon: momentum for its matrices, Adam moments for the rest); other optimizers keep
    their lazy state."""
    initialize_state = getattr(optimizer, "initialize_state", None)
    if callable(initialize_state):
        _call_initialize_state(optimizer, initialize_state)
        return
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return
    for param_group in optimizer.param_groups:
        for param in param_group["params"]:
            state = optimizer.state[param]
            if state:
                continue
            on_device = param_group.get("capturable") or param_group.get("fused")
            state["step"] = (torch.zeros((), dtype=_scalar_dtype(), device=param.device) if on_device
                             else torch.tensor(0.0, dtype=_scalar_dtype()))
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if param_group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


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

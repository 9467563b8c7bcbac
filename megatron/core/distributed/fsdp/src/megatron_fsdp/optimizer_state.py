"""Optimizer state created up front: what a first step would create, without stepping."""

import torch


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def initialize_optimizer_state(optimizer: torch.optim.Optimizer):
    """Create Adam/AdamW state as a first step would, without stepping: zero moments and a step count of 0,
    so the first real update equals a fresh optimizer's. An optimizer with an `initialize_state()` method
    creates its own (Megatron's Muon: momentum for its matrices, Adam moments for the rest); other optimizers keep
    their lazy state."""
    if callable(getattr(optimizer, "initialize_state", None)):
        optimizer.initialize_state()
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

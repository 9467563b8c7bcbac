"""Optimizer state that torch creates on an optimizer's first step only, and how a fresh optimizer still loads it.

torch's SGD with momentum has no `momentum_buffer` until its first step, which sets the buffer to the gradient
(`buf = grad.clone()`, not `momentum * 0 + (1 - dampening) * grad`). The load targets of a fresh optimizer are
built from the state it holds, so they would not ask for a saved buffer. `first_step_state(optimizer)` gives
every parameter without a buffer a zero one while the targets are built and removes them afterwards; loading
installs a buffer only where the checkpoint held one, so a parameter without a saved buffer (and a run that
loads nothing) keeps torch's first-step rule.
"""

import contextlib
from typing import Dict, List

import torch


def _torch_optimizers(optimizer) -> List[torch.optim.Optimizer]:
    """The torch optimizers behind a Megatron optimizer (chained, per Megatron-FSDP chunk, or plain)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for each in chained for inner in _torch_optimizers(each)]
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    inner = getattr(optimizer, "optimizer", None)
    return _torch_optimizers(inner) if inner is not None else []


def _missing_momentum_buffers(torch_optimizer) -> Dict[torch.Tensor, torch.Tensor]:
    """{parameter: zero buffer} for the parameters of an SGD with momentum that have no buffer yet."""
    if not isinstance(torch_optimizer, torch.optim.SGD):
        return {}
    buffers = {}
    for group in torch_optimizer.param_groups:
        if not group.get("momentum"):
            continue
        for param in group["params"]:
            if torch_optimizer.state.get(param, {}).get("momentum_buffer") is None:
                buffers[param] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return buffers


@contextlib.contextmanager
def first_step_state(optimizer):
    """Within the block, `optimizer` holds (zero) the state its first step would create lazily."""
    added = []
    for torch_optimizer in _torch_optimizers(optimizer):
        for param, buffer in _missing_momentum_buffers(torch_optimizer).items():
            state = torch_optimizer.state[param]
            state["momentum_buffer"] = buffer
            added.append((torch_optimizer, param, state, buffer))
    try:
        yield
    finally:
        for torch_optimizer, param, state, buffer in added:
            if state.get("momentum_buffer") is buffer:
                del state["momentum_buffer"]
            if not state:
                del torch_optimizer.state[param]

"""Which optimizer state a logical (sharded) checkpoint holds, and the state a fresh optimizer must ask it for.

The logical checkpoint (`sharded_state_dict`) keeps, per parameter, the state tensors shaped like the parameter
(Adam's moments, Rprop's `prev` and `step_size`, ...) and one global step count. Per-parameter state of another
shape (NAdam's `mu_product`, ASGD's `eta` and `mu`) would be lost on resume, so saving or loading an optimizer
that keeps such state that way is refused, naming the keys. The scales of moments stored scaled are not lost: the
checkpoint holds the moments' values (`get_unscaled_state`).

Torch optimizers that create their state on their first step (Rprop, ASGD) have none in a fresh optimizer, whose
load targets would then not ask for it. A one-element copy of the optimizer with the group's settings steps once
to show which state a first step creates; while the targets are built each parameter without state holds zeros
for those keys, removed afterwards, and the loader installs the ones the checkpoint held.
"""

import contextlib

import torch

from megatron.core.optimizer.precision_aware_adam import SCALE_KEYS


def torch_optimizers(optimizer):
    """The torch optimizers holding the state of a Megatron optimizer's inner `optimizer` (each of them where it
    chains several, as Megatron-FSDP's per-chunk optimizers)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        return [optimizer]
    return [inner for each in chained for inner in torch_optimizers(each)]


def unsaved_state_keys(torch_optimizer, param, state):
    """The keys of `param`'s `state` that the logical checkpoint does not hold (see the module docstring)."""
    scales = set(SCALE_KEYS.values()) if callable(getattr(torch_optimizer, "get_unscaled_state", None)) else set()
    return sorted(key for key, value in state.items()
                  if key != "step" and key not in scales and value is not None
                  and not (torch.is_tensor(value) and value.dim() > 0 and value.shape == param.shape))


def _refuse(torch_optimizer, keys):
    raise ValueError(
        f"{type(torch_optimizer).__name__} keeps per-parameter state {keys} that the logical optimizer checkpoint "
        "(sharded_state_dict, --ckpt-format torch_dist) does not hold, so a resume would lose it: checkpoint this "
        "optimizer with optimizer.state_dict() / load_state_dict() instead, or train with Adam, AdamW or SGD.")


def check_state_is_checkpointable(optimizer):
    """Refuse to save the state of `optimizer` (a Megatron optimizer's inner one) if some of it would be lost."""
    for torch_optimizer in torch_optimizers(optimizer):
        for param, state in torch_optimizer.state.items():
            keys = unsaved_state_keys(torch_optimizer, param, state)
            if keys:
                _refuse(torch_optimizer, keys)


def _first_step_state(torch_optimizer, group, param):
    """(probe parameter, its state) after one step of a one-element copy of `torch_optimizer` with `group`'s
    settings, on `param`'s device; None where no such copy can be built or stepped (an optimizer with other
    constructor arguments: its state, if lazy, cannot be anticipated)."""
    probe = torch.nn.Parameter(torch.zeros(1, dtype=param.dtype, device=param.device))
    probe.grad = torch.ones_like(probe)
    settings = {key: value for key, value in group.items() if key != "params"}
    try:
        copy = type(torch_optimizer)([{**settings, "params": [probe]}])
        copy.step()
    except Exception:  # noqa: BLE001  (any constructor or step of an unknown optimizer)
        return None
    return probe, copy.state.get(probe, {})


@contextlib.contextmanager
def lazy_state_to_load(optimizer):
    """Within the block, every parameter without state of a torch optimizer whose first step creates state holds
    zeros for it, so load targets built from the state ask the checkpoint for it (see the module docstring)."""
    added = []
    try:
        for torch_optimizer in torch_optimizers(optimizer):
            for group in torch_optimizer.param_groups:
                missing = [param for param in group["params"]
                           if not torch_optimizer.state.get(param) and not param.is_meta]
                probed = _first_step_state(torch_optimizer, group, missing[0]) if missing else None
                if probed is None:
                    continue
                probe, created = probed
                keys = unsaved_state_keys(torch_optimizer, probe, created)
                if keys:
                    _refuse(torch_optimizer, keys)
                for param in missing:
                    zeros = {key: torch.zeros_like(param, dtype=value.dtype, memory_format=torch.preserve_format)
                             for key, value in created.items() if key != "step" and torch.is_tensor(value)}
                    torch_optimizer.state[param].update(zeros)
                    added.append((torch_optimizer, param, zeros))
        yield
    finally:
        for torch_optimizer, param, zeros in added:
            state = torch_optimizer.state[param]
            for key, value in zeros.items():
                if state.get(key) is value:
                    del state[key]
            if not state:
                del torch_optimizer.state[param]

"""Activation recomputation that reproduces dropout exactly.

`torch.utils.checkpoint` (non-reentrant) restores the default generators' states before it recomputes a
forward, but dropout on tensor-parallel-split activations draws from the model-parallel RNG tracker's own
states, which have moved on by the time backward runs. The contexts here snapshot the tracker's states when the
forward runs, install that snapshot for the recompute and put the then-current states back afterwards, so the
recomputed dropout masks equal the original ones and the RNG stream after backward is the one a run without
recompute would have.

A recomputed forward runs a module's forward a second time. Side effects meant once per forward (the MoE
router's logged auxiliary losses and its expert-bias token counts) check `is_recomputing()` and skip the
second run.
"""

from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint

from megatron.core import tensor_parallel

_recompute_depth = 0


def is_recomputing():
    """Whether a checkpointed forward is being recomputed (inside backward) right now."""
    return _recompute_depth > 0


def _rng_tracker_contexts():
    """A (forward, recompute) pair of contexts for `checkpoint(context_fn=...)`, sharing one snapshot."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    snapshot = {}

    @contextmanager
    def remember_states():
        snapshot["states"] = tracker.get_states()
        yield

    @contextmanager
    def replay_states():
        global _recompute_depth
        states_before_recompute = tracker.get_states()
        tracker.set_states(snapshot["states"])
        _recompute_depth += 1
        try:
            yield
        finally:
            _recompute_depth -= 1
            tracker.set_states(states_before_recompute)

    return remember_states(), replay_states()


def checkpointed(function, *args):
    """`function(*args)`, keeping only its inputs for backward and recomputing the rest there.

    Without autograd recording (e.g. under `torch.no_grad()`) nothing would be saved anyway, so the function
    just runs.
    """
    if not torch.is_grad_enabled():
        return function(*args)
    return checkpoint(function, *args, use_reentrant=False, context_fn=_rng_tracker_contexts)

"""Activation recomputation that reproduces dropout exactly.

`torch.utils.checkpoint` (non-reentrant) restores the default generators' states before it recomputes a
forward, but dropout on tensor-parallel-split activations draws from the model-parallel RNG tracker's own
states, which have moved on by the time backward runs. The contexts here snapshot the tracker's states when the
forward runs, install that snapshot for the recompute and put the then-current states back afterwards, so the
recomputed dropout masks equal the original ones and the RNG stream after backward is the one a run without
recompute would have.
"""

from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint

from megatron.core import tensor_parallel


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
        states_before_recompute = tracker.get_states()
        tracker.set_states(snapshot["states"])
        try:
            yield
        finally:
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

"""Activation recomputation that reproduces dropout exactly.

`torch.utils.checkpoint` (non-reentrant) restores the default generators' states before it recomputes a
forward, but dropout on tensor-parallel-split activations draws from the model-parallel RNG tracker's own
states, which have moved on by the time backward runs. The contexts here snapshot the tracker's states when the
forward runs, install that snapshot for the recompute and put the then-current states back afterwards, so the
recomputed dropout masks equal the original ones and the RNG stream after backward is the one a run without
recompute would have.

`distributed_checkpointed` (`--distribute-saved-activations`) keeps, of a recomputed chunk's input (replicated
across the tensor-parallel ranks without sequence parallelism), only this rank's 1/TP slice between the forward
and the backward; the recompute all-gathers the slices. The forward itself uses the whole input as it is (no
communication), and the input's gradient, identical on every tensor-parallel rank, is handed to it whole from
the recompute (no communication either).

A recomputed forward runs a module's forward a second time. Side effects meant once per forward (the MoE
router's logged auxiliary losses and its expert-bias token counts) check `is_recomputing()` and skip the
second run.
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from megatron.core import parallel_state, tensor_parallel

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


class _OwnSlice(torch.autograd.Function):
    """Forward: this rank's slice of the flattened input (padded to a whole share). Backward: the input's whole
    gradient, which the recompute left in `exchange["grad"]`."""

    @staticmethod
    def forward(ctx, full, rank, share, exchange):
        ctx.exchange = exchange
        flat = full.detach().reshape(-1)
        piece = flat.new_zeros(share)
        own = flat[rank * share:(rank + 1) * share]
        piece[:own.numel()] = own
        return piece

    @staticmethod
    def backward(ctx, grad_piece):
        return ctx.exchange.pop("grad"), None, None, None


class _FromSlices(torch.autograd.Function):
    """Forward: the whole input, `exchange["full"]` in the first forward, else all-gathered from every rank's
    slice. Backward: stores the whole gradient for `_OwnSlice` and passes this rank's slice of it on."""

    @staticmethod
    def forward(ctx, piece, group, rank, shape, exchange):
        ctx.rank, ctx.share, ctx.exchange = rank, piece.numel(), exchange
        full = exchange.pop("full", None)
        if full is not None:  # the first forward: the input itself, no communication
            return full.view(shape)
        gathered = piece.new_empty(piece.numel() * dist.get_world_size(group))
        dist.all_gather_into_tensor(gathered, piece.contiguous(), group=group)
        return gathered[:torch.Size(shape).numel()].view(shape)

    @staticmethod
    def backward(ctx, grad_full):
        ctx.exchange["grad"] = grad_full
        flat = grad_full.reshape(-1)
        grad_piece = flat.new_zeros(ctx.share)
        own = flat[ctx.rank * ctx.share:(ctx.rank + 1) * ctx.share]
        grad_piece[:own.numel()] = own
        return grad_piece, None, None, None, None


def distributed_checkpointed(function, hidden_states, *args):
    """`checkpointed(function, hidden_states, *args)` that keeps only this tensor-parallel rank's 1/TP slice of
    `hidden_states` (the same on every rank of the group) for the recompute, which all-gathers the slices."""
    group = parallel_state.get_tensor_model_parallel_group()
    size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    if not torch.is_grad_enabled() or size == 1:
        return checkpointed(function, hidden_states, *args)
    rank = dist.get_rank(group)
    share = -(-hidden_states.numel() // size)
    exchange = {"full": hidden_states.detach()}
    piece = _OwnSlice.apply(hidden_states, rank, share, exchange)
    shape = tuple(hidden_states.shape)

    def run(piece, *rest):
        return function(_FromSlices.apply(piece, group, rank, shape, exchange), *rest)

    return checkpointed(run, piece, *args)

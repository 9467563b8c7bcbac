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
second run. A `checkpointed` call inside another checkpointed forward (or its recompute) just runs: the outer
checkpoint already keeps only its own inputs.

`output_recomputed_in_backward` (selective `--recompute-modules layernorm moe_act mla_up_proj`) goes further than
a checkpoint: it keeps a function's inputs and also drops its outputs, which the module consuming them would
otherwise save for its own backward. The function runs without recording; inside the returned context, the
consumer's saved references to those outputs are replaced by markers, and the first backward step that needs one
recomputes the function (recording this time) and serves every marker from that result; the outputs' gradient
then flows through the recomputed graph (as with upstream's output-discarding checkpoint and reentrant
checkpointing, the function's own parameters get their gradients in that inner backward, so use `backward()`,
not `torch.autograd.grad`, over them). The function must be deterministic (no dropout).
"""

from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from megatron.core import parallel_state, tensor_parallel

_recompute_depth = 0
_checkpointed_forward_depth = 0


def is_recomputing():
    """Whether a checkpointed forward is being recomputed (inside backward) right now."""
    return _recompute_depth > 0


def inside_checkpointed_region():
    """Whether a checkpointed forward runs (first time or recomputed) right now."""
    return _checkpointed_forward_depth > 0 or _recompute_depth > 0


class _Reenterable:
    """A context manager that a new context from `make()` serves each time it is entered. torch's checkpoint enters
    its recompute context once per recompute, and a chunk is recomputed once per backward pass that reaches it: a
    graph back-propagated twice (`retain_graph=True`), or a backward run inside the checkpointed forward (a
    capability probe) that unpacks a tensor the checkpoint packed."""

    def __init__(self, make):
        self.make = make
        self.entered = []

    def __enter__(self):
        context = self.make()
        self.entered.append(context)
        return context.__enter__()

    def __exit__(self, *exception):
        return self.entered.pop().__exit__(*exception)


def _rng_tracker_contexts():
    """A (forward, recompute) pair of contexts for `checkpoint(context_fn=...)`, sharing one snapshot; the
    recompute context may be entered any number of times, each time replaying the snapshot."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    snapshot = {}

    @contextmanager
    def remember_states():
        global _checkpointed_forward_depth
        snapshot["states"] = tracker.get_states()
        _checkpointed_forward_depth += 1
        try:
            yield
        finally:
            _checkpointed_forward_depth -= 1

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

    return remember_states(), _Reenterable(replay_states)


def checkpointed(function, *args):
    """`function(*args)`, keeping only its inputs for backward and recomputing the rest there.

    Without autograd recording (e.g. under `torch.no_grad()`) nothing would be saved anyway, and inside another
    checkpointed forward only the outer inputs are kept anyway: there the function just runs.
    """
    if not torch.is_grad_enabled() or inside_checkpointed_region():
        return function(*args)
    return checkpoint(function, *args, use_reentrant=False, context_fn=_rng_tracker_contexts)


class _DroppedOutputs:
    """What one `output_recomputed_in_backward` call shares between its autograd node and its saved-tensor hooks:
    the function, the storages of the outputs it dropped, and the recomputed result once backward made it."""

    def __init__(self, function, inputs):
        self.function = function
        self.inputs = inputs  # the autograd node needs them for backward anyway
        self.output_storages = {}
        self.recomputed = None  # (detached inputs that require grad, outputs with their graph)

    def recompute(self):
        global _recompute_depth
        if self.recomputed is None:
            detached = [tensor.detach().requires_grad_(tensor.requires_grad) for tensor in self.inputs]
            _recompute_depth += 1
            try:
                with torch.enable_grad():
                    outputs = self.function(*detached)
            finally:
                _recompute_depth -= 1
            self.recomputed = detached, outputs if isinstance(outputs, tuple) else (outputs,)
        return self.recomputed

    def pack(self, tensor):
        try:
            index = self.output_storages.get(tensor.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage are kept as they are
            index = None
        if index is None:
            return tensor
        return _DroppedMarker(index, tensor.size(), tensor.stride(), tensor.storage_offset())

    def unpack(self, packed):
        if not isinstance(packed, _DroppedMarker):
            return packed
        _, outputs = self.recompute()
        output = outputs[packed.index].detach()
        return output.as_strided(packed.size, packed.stride, packed.storage_offset)


class _DroppedMarker:
    __slots__ = ("index", "size", "stride", "storage_offset")

    def __init__(self, index, size, stride, storage_offset):
        self.index, self.size, self.stride, self.storage_offset = index, size, stride, storage_offset


class _RecomputedInBackward(torch.autograd.Function):
    """Runs `state.function(*inputs)` unrecorded; backward back-propagates through its recomputed graph."""

    @staticmethod
    def forward(ctx, state, *inputs):
        ctx.state = state
        return state.function(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        state = ctx.state
        detached, outputs = state.recompute()
        state.recomputed = state.inputs = None
        pairs = [(output, grad) for output, grad in zip(outputs, grads) if grad is not None and output.requires_grad]
        if pairs:
            torch.autograd.backward([output for output, _ in pairs], [grad for _, grad in pairs])
        return (None, *[tensor.grad if tensor.requires_grad else None for tensor in detached])


def output_recomputed_in_backward(function, *inputs):
    """(`function(*inputs)`, a context to run the outputs' consumer in): the outputs are not kept for backward,
    neither the function's own saved tensors nor the consumer's saved references to the outputs; backward
    recomputes them from `inputs` (which are kept). `function` takes and returns tensors (one or a tuple).

    Without autograd recording, or inside a checkpointed forward (whose checkpoint keeps only its inputs), it is
    `(function(*inputs), nullcontext())`."""
    if not torch.is_grad_enabled() or inside_checkpointed_region():
        return function(*inputs), nullcontext()
    state = _DroppedOutputs(function, inputs)
    outputs = _RecomputedInBackward.apply(state, *inputs)
    for index, output in enumerate(outputs if isinstance(outputs, tuple) else (outputs,)):
        if output.numel() > 0:
            state.output_storages[output.untyped_storage().data_ptr()] = index
    return outputs, torch.autograd.graph.saved_tensors_hooks(state.pack, state.unpack)


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

"""Random-number streams for model parallelism, and activation recomputation that replays them.

Dropout inside a tensor-parallel region must differ between tensor-parallel ranks (each holds different
activations) while dropout outside it must agree. The default generator of this process's device is seeded
identically on every rank; the tracker keeps extra named generator states ("model-parallel-rng" seeded per
tensor-parallel rank) and `fork(name)` swaps one in for the duration of a block. "cuda" in the names is
historical: the generator is the one of the current device, the CPU generator when running on gloo.
"""

import contextlib

import torch

from megatron.core import parallel_state
from megatron.core.device_utils import get_current_device, get_rng_state, manual_seed_device, set_rng_state
from megatron.core.tensor_parallel.utils import gather_split_1d_tensor, split_tensor_into_1d_equal_chunks

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"
MODEL_PARALLEL_SEED_OFFSET = 2718
EXPERT_PARALLEL_SEED_OFFSET = 1024


class RNGStatesTracker:
    """Named generator states for the current device; `fork(name)` runs a block on one of them."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()

    def is_initialized(self):
        return bool(self.states_)

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = dict(states)

    def add(self, name, seed):
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already used by another random-number stream")
        if name in self.states_:
            raise ValueError(f"random-number stream {name!r} already exists")
        self.seeds_.add(seed)
        device = get_current_device()
        saved = get_rng_state(device)
        manual_seed_device(seed, device)
        self.states_[name] = get_rng_state(device)
        set_rng_state(saved, device)

    @contextlib.contextmanager
    def fork(self, name=_MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Run the block with the device generator set to stream `name`; the stream advances, the default does not."""
        if name not in self.states_:
            raise KeyError(f"random-number stream {name!r} is not registered; call model_parallel_cuda_manual_seed")
        device = get_current_device()
        saved = get_rng_state(device)
        set_rng_state(self.states_[name], device)
        try:
            yield
        finally:
            self.states_[name] = get_rng_state(device)
            set_rng_state(saved, device)


_RNG_STATE_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker(use_te_rng_tracker=False, inference_rng_tracker=False, use_cudagraphable_rng=False):
    """The process-wide tracker (for the current device, despite the name). Upstream's switches for its other
    trackers are accepted left False and refused otherwise, as in `model_parallel_cuda_manual_seed`."""
    _refuse_other_trackers("get_cuda_rng_tracker", use_te_rng_tracker=use_te_rng_tracker,
                           inference_rng_tracker=inference_rng_tracker, use_cudagraphable_rng=use_cudagraphable_rng)
    return _RNG_STATE_TRACKER


def _refuse_other_trackers(caller, **switches):
    for name, value in switches.items():
        if value:
            raise ValueError(f"{caller}({name}=True) asks for a random-number tracker this implementation does "
                             "not have; leave it False (the one tracker serves training and inference)")


def get_data_parallel_rng_tracker_name():
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def get_expert_parallel_rng_tracker_name():
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def model_parallel_cuda_manual_seed(seed, te_rng_tracker=False, inference_rng_tracker=False,
                                    use_cudagraphable_rng=False, tp_rank=None, ep_rank=None, etp_rank=None,
                                    force_reset_rng=False):
    """Seed the default generators with `seed` and register the model-, expert- and data-parallel streams.

    The default stream is identical on all ranks (so weights initialised outside `fork` agree); the
    model-parallel stream is `seed + 2718 + tensor_model_parallel_rank`, the expert-parallel one
    `seed + 1024 + 100 * expert_model_parallel_rank + expert_tensor_parallel_rank` (experts are split over the
    expert-tensor-parallel group, which differs from the tensor-parallel one under
    `--expert-tensor-parallel-size`). `tp_rank`, `ep_rank` and `etp_rank` (upstream's keywords) replace the ranks
    parallel_state reports; `force_reset_rng` is accepted (the tracker is always reset). Upstream's other trackers
    (Transformer Engine's, the inference one, CUDA-graph-safe generators) are refused: leave those switches False.
    """
    _refuse_other_trackers("model_parallel_cuda_manual_seed", te_rng_tracker=te_rng_tracker,
                           inference_rng_tracker=inference_rng_tracker, use_cudagraphable_rng=use_cudagraphable_rng)
    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    if ep_rank is None:
        ep_rank = parallel_state.get_expert_model_parallel_rank()
    if etp_rank is None:
        etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    torch.manual_seed(seed)  # CPU and every accelerator's default generator
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank)
    tracker.add(
        _EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + EXPERT_PARALLEL_SEED_OFFSET + 100 * ep_rank + etp_rank
    )


# --------------------------------------------------------------------------------------------------------
# Activation recomputation
# --------------------------------------------------------------------------------------------------------


def _capture_rng_states():
    device = get_current_device()
    return torch.get_rng_state(), get_rng_state(device), get_cuda_rng_tracker().get_states()


def _restore_rng_states(states):
    cpu_state, device_state, tracker_states = states
    device = get_current_device()
    torch.set_rng_state(cpu_state)
    set_rng_state(device_state, device)
    get_cuda_rng_tracker().set_states(tracker_states)


class CheckpointFunction(torch.autograd.Function):
    """Run `function` without keeping activations; recompute it in backward under the same RNG states. With
    `distribute_saved_activations` only this tensor-parallel rank's 1/TP of the first argument (flattened) is kept
    until backward, which all-gathers it over the tensor-parallel group."""

    @staticmethod
    def forward(ctx, function, distribute_saved_activations, *args):
        ctx.function = function
        ctx.rng_states = _capture_rng_states()
        with torch.no_grad():
            outputs = function(*args)
        saved_args = list(args)
        ctx.distributed_input = None
        if distribute_saved_activations:
            ctx.distributed_input = (args[0].shape, args[0].requires_grad)
            saved_args[0] = split_tensor_into_1d_equal_chunks(args[0].detach(), new_buffer=True)
        tensor_args = [a if torch.is_tensor(a) else None for a in saved_args]
        ctx.non_tensor_args = [None if torch.is_tensor(a) else a for a in saved_args]
        ctx.save_for_backward(*[a for a in tensor_args if a is not None])
        ctx.tensor_positions = [i for i, a in enumerate(tensor_args) if a is not None]
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("activation recomputation does not support torch.autograd.grad; use .backward()")
        args = list(ctx.non_tensor_args)
        for position, saved in zip(ctx.tensor_positions, ctx.saved_tensors):
            requires_grad = saved.requires_grad
            if position == 0 and ctx.distributed_input is not None:
                shape, requires_grad = ctx.distributed_input
                saved = gather_split_1d_tensor(saved).view(shape)
            detached = saved.detach()
            detached.requires_grad_(requires_grad)
            args[position] = detached
        states_now = _capture_rng_states()
        _restore_rng_states(ctx.rng_states)
        try:
            with torch.enable_grad():
                outputs = ctx.function(*args)
        finally:
            _restore_rng_states(states_now)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if torch.is_tensor(o) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = tuple(a.grad if torch.is_tensor(a) and a.requires_grad else None for a in args)
        return (None, None) + grads


def checkpoint(function, distribute_saved_activations, *args):
    """Recompute `function(*args)` during backward instead of storing its activations.

    With `distribute_saved_activations` (upstream's `--distribute-saved-activations`) the first argument, a tensor
    that must be the same on every tensor-parallel rank (no sequence parallelism), is kept as this rank's 1/TP of
    its flattened elements and all-gathered for the recompute.
    """
    if distribute_saved_activations:
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        if not args or not torch.is_tensor(args[0]):
            raise ValueError("checkpoint(function, distribute_saved_activations=True, *args) splits the first "
                             "argument across tensor-parallel ranks: pass a tensor first")
        if args[0].numel() % tp_size != 0:
            raise ValueError(f"checkpoint(distribute_saved_activations=True): the first argument has "
                             f"{args[0].numel()} elements, not divisible by the tensor-parallel size {tp_size}; "
                             "pass distribute_saved_activations=False for it")
    return CheckpointFunction.apply(function, bool(distribute_saved_activations), *args)


class _CheckpointWithoutOutputFunction(torch.autograd.Function):
    """Runs the function without recording; its backward pushes the gradient through the recomputed graph."""

    @staticmethod
    def forward(ctx, run_function, owner, *args):
        with torch.no_grad():
            outputs = run_function(*args)
        owner.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        owner = ctx.owner
        if ctx.recomputed_outputs is None:  # the hook tensor's gradient did not come first: recompute now
            owner._recompute(None)
        pairs = [(output, grad) for output, grad in zip(ctx.recomputed_outputs, grad_outputs)
                 if torch.is_tensor(output) and output.requires_grad and grad is not None]
        if pairs:
            torch.autograd.backward([output for output, _ in pairs], [grad for _, grad in pairs])
        ctx.recomputed_outputs = None
        ctx.owner = None
        grads = tuple(arg.grad if torch.is_tensor(arg) and arg.requires_grad else None for arg in ctx.inputs)
        ctx.inputs = None
        return (None, None) + grads


class CheckpointWithoutOutput:
    """Recompute a function in backward and also free its outputs in between (upstream's API).

    `checkpoint(run_function, *args)` runs the function without recording a graph and returns its outputs.
    Once the caller has used them (typically as the input of the next layer, which saves them for its own
    backward), `discard_output_and_register_recompute(hook_tensor)` frees their storage and registers the
    recompute on `hook_tensor`'s gradient: when backward reaches `hook_tensor` (a tensor computed from the
    outputs, e.g. the next layer's output) the function is rerun under the forward's RNG states and the
    recomputed values are written back into the outputs' storage before anything reads them. `fp8` is
    accepted for upstream's signature; the recompute runs under whatever precision context is active then.
    """

    def __init__(self, fp8=False):
        self.fp8 = fp8
        self.run_function = None
        self.rng_states = None
        self.ctx = None
        self.outputs = None

    def checkpoint(self, run_function, *args):
        self.run_function = run_function
        self.rng_states = _capture_rng_states()
        outputs = _CheckpointWithoutOutputFunction.apply(run_function, self, *args)
        ctx = self.ctx
        ctx.owner = self
        ctx.recomputed_outputs = None
        ctx.inputs = [_detached_like(arg) for arg in args]
        self.outputs = (outputs,) if torch.is_tensor(outputs) else tuple(outputs)
        return outputs

    def _recompute(self, _grad):
        ctx = self.ctx
        if ctx is None:  # already recomputed
            return
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("CheckpointWithoutOutput does not support torch.autograd.grad; use .backward()")
        states_now = _capture_rng_states()
        _restore_rng_states(self.rng_states)
        try:
            with torch.enable_grad():
                recomputed = self.run_function(*ctx.inputs)
        finally:
            _restore_rng_states(states_now)
        recomputed = (recomputed,) if torch.is_tensor(recomputed) else tuple(recomputed)
        with torch.no_grad():
            for output, value in zip(self.outputs, recomputed):
                if torch.is_tensor(output) and output.untyped_storage().size() == 0:
                    output.untyped_storage().resize_(value.untyped_storage().size())
                    output.untyped_storage().copy_(value.untyped_storage())
        ctx.recomputed_outputs = recomputed
        self.run_function = self.rng_states = self.outputs = self.ctx = None

    def discard_output_and_register_recompute(self, hook_tensor):
        """Free the outputs' storage (shapes stay) and recompute them when `hook_tensor`'s gradient is computed.
        The caller must not read the outputs in the forward after this call."""
        if self.ctx is None:
            raise RuntimeError("discard_output_and_register_recompute() needs a checkpoint() call first")
        for output in self.outputs:
            if torch.is_tensor(output):
                output.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute)


def _detached_like(arg):
    if not torch.is_tensor(arg):
        return arg
    detached = arg.detach()
    detached.requires_grad_(arg.requires_grad)
    return detached

"""Per-tensor scaling state and the amax reductions that make ranks agree on one scale.

Each FP8 linear layer owns one `ScalingState` per tensor role (input, weight, gradient of the output). Ranks
that hold shards of one logical tensor must quantize it with the same scale, or the shards would not form
one FP8 tensor: tensor-parallel shards reduce the amax (MAX) over the tensor-parallel group, and under
delayed scaling the amaxes recorded in a forward pass are reduced over the pipeline stage's amax-reduction group
(its TP x DP x CP ranks), as Megatron does, so every shard and replica of a layer uses identical scales. That
reduction runs once per optimizer step for all layers together (`reduce_fp8_amaxes`), in one collective.
"""

import torch
import torch.distributed as dist

from megatron.core.fp8.recipe import Fp8RecipeSettings
from megatron.core.fp8.tensor import (
    ScaledFloat8,
    amax,
    fused_amax_recording_available,
    quantize_by_amax,
    quantize_recording_amax,
    quantize_with_scales,
    scale_from_amax,
    scales_from_amax,
    without_autograd,
)

NO_AMAX = -1.0  # marks "nothing recorded" in a reduced amax vector (real amaxes are >= 0)


def tensor_parallel_group_if_sharded():
    """The tensor-parallel group when it has more than one rank, else None."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


def amax_reduction_group(tp_only_amax_red: bool = False):
    """The group over which delayed-scaling amaxes are reduced: every rank of this pipeline stage (TP x DP x CP,
    `parallel_state.get_amax_reduction_group(with_context_parallel=True)`), only its tensor-parallel group with
    `tp_only_amax_red` (`--tp-only-amax-red`: shards agree, data-parallel replicas keep their own histories), or
    None when that is one rank or no model-parallel state exists. Transformer Engine's autocast gets the same
    group as its `fp8_group`."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_amax_reduction_group(with_context_parallel=True, tp_only_amax_red=tp_only_amax_red)
    return group if dist.get_world_size(group) > 1 else None


def amax_reduction_groups(tp_only_amax_red: bool = False):
    """`[amax_reduction_group(...)]`, or `[]` when there is nothing to reduce over (the form the reductions take)."""
    group = amax_reduction_group(tp_only_amax_red)
    return [] if group is None else [group]


def all_reduce_max(tensor, groups):
    """In-place MAX over each group in turn (fp32 only: gloo cannot reduce float8)."""
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def _version_of(tensor):
    """`tensor`'s version counter (every in-place write bumps it); None for an inference tensor, which has none."""
    return None if tensor.is_inference() else tensor._version


class ScalingState:
    """The scale of one tensor role of one module.

    Args:
        recipe: the run's `Fp8RecipeSettings`.
        dtype: the float8 dtype this role is stored in.
        sharded_over_tensor_parallel: the tensor is split across tensor-parallel ranks (so its amax is reduced
            over them); replicated tensors already agree.
        history_storage, count_storage: `[amax_history_len]` fp32 and `[1]` int64 tensors holding the history and
            its fill count (e.g. rows of a module's buffers, so checkpoints carry them); new ones on the CPU when
            not given. They stay where they are: keep them on the device of the tensors quantized (buffers move
            with their module).

    Nothing here synchronises with the host: amaxes stay on the device, pending ones are combined with MAX until
    `reduce_and_record_amaxes` pushes them into the history. Under delayed scaling the scale the history gives is
    computed once per record and reused by every quantization until the next one.

    A write into the history storage other than a record (a checkpoint load that copies into the buffers in place,
    as Megatron-FSDP's `load_state_dict` does) is seen by the storage's version counter: the state then forgets
    what it knew of the old history (the host-side `has_history`, the scale it gave) and the amaxes pending from
    before the write, as a state built after the load would.
    """

    def __init__(self, recipe: Fp8RecipeSettings, dtype: torch.dtype, sharded_over_tensor_parallel: bool,
                 history_storage=None, count_storage=None):
        self.recipe = recipe
        self.dtype = dtype
        self.sharded_over_tensor_parallel = sharded_over_tensor_parallel
        # Storage of its own follows the tensors quantized (moved once, at the first quantize on another device).
        self._owns_storage = history_storage is None
        if history_storage is None:
            history_storage = torch.zeros(recipe.amax_history_len, dtype=torch.float32)
        if history_storage.shape != (recipe.amax_history_len,):
            raise ValueError(f"amax history storage of shape {tuple(history_storage.shape)} for history length "
                             f"{recipe.amax_history_len}")
        self.amax_history = history_storage
        self.recorded_count = count_storage if count_storage is not None else torch.zeros(1, dtype=torch.int64)
        self.pending_amax = None  # device scalar: MAX of the amaxes seen since the last record
        # Known on the host without looking at the device: a history was recorded since this state was built
        # (False after a load, until the next record: the device-side count then decides, see `_amax_for_scale`).
        self.has_history = False
        self.generation = 0  # bumped by every record (the scale may have changed)
        # The history storage's version counter as of the last record (or this state's construction): any other
        # write into it since then was a load (see `_notice_overwritten_history`).
        self._history_version = _version_of(self.amax_history)
        # Under delayed scaling with a known history: the amax it gives and, where the eager kernels quantize, the
        # `Scales` from it, on the device they were computed for; None until first used after a record.
        self._history_amax = None
        self._history_scales = None

    @property
    def num_recorded(self) -> int:
        """How many amaxes the history has recorded (reads the device: for tests and reports, not hot paths)."""
        return int(self.recorded_count.item())

    # ---- scale selection --------------------------------------------------------------------------------------
    def _current_amax(self, local_amax):
        if self.sharded_over_tensor_parallel:
            group = tensor_parallel_group_if_sharded()
            if group is not None:
                local_amax = local_amax.reshape(1).clone()
                all_reduce_max(local_amax, [group])
                return local_amax[0]
        return local_amax

    def history_amax(self) -> torch.Tensor:
        if self.recipe.amax_compute_algo == "max":
            return self.amax_history.max()
        return self.amax_history[0]

    def _notice_overwritten_history(self):
        """If the history storage was written since the last record (a load in place), start over as a state
        built after the load: no history known on the host, and the amaxes pending from before it dropped."""
        version = _version_of(self.amax_history)
        if version != self._history_version:
            self._history_version = version
            self.has_history = False
            self.pending_amax = None
            self._forget_history_scales()

    def _forget_history_scales(self):
        self._history_amax = None
        self._history_scales = None

    def _record_pending(self, local_amax):
        self.pending_amax = local_amax if self.pending_amax is None else torch.maximum(self.pending_amax, local_amax)

    def _follow_device(self, tensor):
        if self._owns_storage and self.amax_history.device != tensor.device:
            self.amax_history = self.amax_history.to(tensor.device)
            self.recorded_count = self.recorded_count.to(tensor.device)
            self._history_version = _version_of(self.amax_history)
            self._forget_history_scales()

    def _known_history_amax(self, device) -> torch.Tensor:
        """The amax the known history gives, on `device` (computed once per record)."""
        history_amax = self._history_amax
        if history_amax is None or history_amax.device != device:
            history_amax = self._history_amax = self.history_amax().to(device)
        return history_amax

    def _amax_for_scale(self, tensor: torch.Tensor) -> torch.Tensor:
        local_amax = amax(tensor)
        if not self.recipe.is_delayed:
            return self._current_amax(local_amax)
        self._follow_device(tensor)
        self._notice_overwritten_history()
        self._record_pending(local_amax)
        if self.has_history:
            return self._known_history_amax(tensor.device)
        # No history known on the host (the first step, or just loaded): the history where the device-side count
        # says there is one, else this tensor's own amax, rather than an arbitrary scale of 1.
        history = self.history_amax().to(tensor.device)
        recorded = self.recorded_count[0].to(tensor.device) > 0
        return torch.where(recorded, history, self._current_amax(local_amax))

    def scale_for(self, tensor: torch.Tensor) -> torch.Tensor:
        """The scale to quantize `tensor` with; under delayed scaling also records its amax as pending."""
        return scale_from_amax(self._amax_for_scale(tensor), self.dtype, self.recipe.scale_margin)

    def quantize(self, tensor: torch.Tensor, with_transpose: bool = False) -> ScaledFloat8:
        """`tensor` in FP8 with this role's scale (scale, reciprocal and bytes from one pass)."""
        tensor = without_autograd(tensor)  # once here rather than in each op below
        if self.recipe.is_delayed:
            self._follow_device(tensor)
            self._notice_overwritten_history()
            if self.has_history:
                return self._quantize_by_known_history(tensor, with_transpose)
        return quantize_by_amax(tensor, self.dtype, self._amax_for_scale(tensor), self.recipe.scale_margin,
                                with_transpose=with_transpose)

    def _quantize_by_known_history(self, tensor, with_transpose):
        device = tensor.device
        if fused_amax_recording_available(tensor, self.dtype):
            # The scale comes from the history; the tensor's own amax is recorded from the same pass.
            fp8, local_amax = quantize_recording_amax(tensor, self.dtype, self._known_history_amax(device),
                                                      self.recipe.scale_margin, with_transpose=with_transpose)
            self._record_pending(local_amax)
            return fp8
        self._record_pending(amax(tensor))
        scales = self._history_scales
        if scales is None or scales.scale.device != device:
            scales = self._history_scales = scales_from_amax(self._known_history_amax(device), self.dtype,
                                                             self.recipe.scale_margin)
        return quantize_with_scales(tensor, self.dtype, scales, with_transpose=with_transpose)


def reduce_and_record_amaxes(states, groups):
    """Reduce the pending amaxes of `states` (same order on every rank) in one collective over `groups` and push
    them into the histories, all on the device: no host synchronisation. A state with nothing pending on every
    rank records nothing. An entry may be None: a position this rank holds no state for (an expert of another
    expert-parallel rank), which contributes nothing and records nothing here."""
    from megatron.core.device_utils import get_device_for_group

    if not states:
        return
    present = [state for state in states if state is not None]
    for state in present:
        state._notice_overwritten_history()
    device = present[0].amax_history.device if present else get_device_for_group(groups[0] if groups else None)
    nothing = torch.full((), NO_AMAX, dtype=torch.float32, device=device)
    pending = torch.stack([nothing if state is None or state.pending_amax is None else state.pending_amax.to(device)
                           for state in states])
    if groups:
        pending = all_reduce_max(pending.to(get_device_for_group(groups[0])), groups).to(device)
    valid = pending >= 0
    by_length = {}
    for index, state in enumerate(states):
        if state is not None:
            by_length.setdefault(state.amax_history.shape[0], []).append(index)
    for indices in by_length.values():
        chosen = [states[index] for index in indices]
        index_tensor = torch.tensor(indices, device=device)
        histories = torch.stack([state.amax_history for state in chosen])
        chosen_valid = valid.index_select(0, index_tensor)
        pushed = torch.cat([pending.index_select(0, index_tensor).unsqueeze(1), histories[:, :-1]], dim=1)
        updated = torch.where(chosen_valid.unsqueeze(1), pushed, histories)
        torch._foreach_copy_([state.amax_history for state in chosen], list(updated.unbind(0)))
        counts = chosen_valid.to(torch.int64).unsqueeze(1)
        torch._foreach_add_([state.recorded_count for state in chosen], list(counts.unbind(0)))
    for state in present:
        if state.pending_amax is not None:
            state.has_history = True
        state.pending_amax = None
        state.generation += 1
        state._history_version = _version_of(state.amax_history)
        state._forget_history_scales()


def _collect_step_states(module, states, seen):
    """`module`'s FP8 step states in module order (as `nn.Module.modules()` visits them). A module that places
    its states by a global position (`fp8_step_states_by_global_expert`: the experts of a MoE layer) answers
    for its whole subtree."""
    if id(module) in seen:
        return
    seen.add(id(module))
    by_global_expert = getattr(module, "fp8_step_states_by_global_expert", None)
    if by_global_expert is not None:
        states.extend(by_global_expert())
        return
    step_states = getattr(module, "fp8_step_states", None)
    if step_states is not None:
        states.extend(step_states())
    for child in module.children():
        _collect_step_states(child, states, seen)


def reduce_fp8_amaxes(model_chunks) -> None:
    """Once per optimizer step, after forward and backward of all microbatches: reduce every FP8 layer's pending
    delayed-scaling amaxes over the pipeline stage's amax-reduction group in one collective, record them, and
    start the step's FP8 weight caches anew (the optimizer step is about to change the weights).

    With `--tp-only-amax-red` (the chunks' config's `tp_only_amax_red`) the group is the tensor-parallel one.
    Every rank of the amax-reduction group must call it (the layers' order is the modules' order, the same on
    every rank). Layers take part through their `fp8_step_states()` method (the tensor-parallel linear layers);
    MoE experts through `fp8_step_states_by_global_expert()`, one position per state of every expert of the
    layer (None where another expert-parallel rank holds it), so that an expert's amaxes are reduced over the
    ranks that hold that expert (its tensor-parallel shards and expert data-parallel replicas) and no other.
    """
    states, seen = [], set()
    for chunk in model_chunks:
        _collect_step_states(chunk, states, seen)
    tp_only = any(getattr(_model_config(chunk), "tp_only_amax_red", False) for chunk in model_chunks)
    reduce_and_record_amaxes(states, amax_reduction_groups(tp_only))


def _model_config(chunk):
    """The model config of a model chunk, wrapped (DDP, Megatron-FSDP, FSDP2) or not; None where it has none."""
    config = getattr(chunk, "config", None)
    return config if config is not None else getattr(getattr(chunk, "module", None), "config", None)


class LinearScaling:
    """The three scaling states of one FP8 linear layer.

    Column-parallel layers hold an output-feature shard of the weight and of the output gradient; row-parallel
    ones an input-feature shard of the input and of the weight.
    """

    ROLES = ("input", "weight", "grad_output")

    def __init__(self, recipe: Fp8RecipeSettings, parallel_mode: str, history_storage=None, count_storage=None):
        """`history_storage` `[3, amax_history_len]` fp32 and `count_storage` `[3]` int64 (optional) hold the
        three roles' histories, e.g. as module buffers."""
        if parallel_mode not in ("column", "row", "none"):
            raise ValueError(f"parallel_mode must be column, row or none, got {parallel_mode!r}")
        fmt = recipe.fp8_format
        self.recipe = recipe
        sharded = {"input": parallel_mode == "row", "weight": parallel_mode != "none",
                   "grad_output": parallel_mode == "column"}
        dtypes = {"input": fmt.forward_dtype, "weight": fmt.forward_dtype, "grad_output": fmt.backward_dtype}
        for index, role in enumerate(self.ROLES):
            state = ScalingState(
                recipe,
                dtypes[role],
                sharded[role],
                history_storage=None if history_storage is None else history_storage[index],
                count_storage=None if count_storage is None else count_storage[index:index + 1],
            )
            setattr(self, role, state)

    def states(self):
        return tuple(getattr(self, role) for role in self.ROLES)

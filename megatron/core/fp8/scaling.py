"""Per-tensor scaling state and the amax reductions that make ranks agree on one scale.

Each FP8 linear layer owns one `ScalingState` per tensor role (input, weight, gradient of the output). Ranks
that hold shards of one logical tensor must quantize it with the same scale, or the shards would not form
one FP8 tensor: tensor-parallel shards reduce the amax (MAX) over the tensor-parallel group, and under
delayed scaling the amaxes recorded in a forward pass are reduced over the pipeline stage's amax-reduction group
(its TP x DP x CP ranks), as Megatron does, so every shard and replica of a layer uses identical scales.
"""

import torch
import torch.distributed as dist

from megatron.core.fp8.recipe import Fp8Recipe
from megatron.core.fp8.tensor import Float8Tensor, amax, quantize, scale_from_amax

NO_AMAX = -1.0  # marks "nothing recorded" in a reduced amax vector (real amaxes are >= 0)


def tensor_parallel_group_if_sharded():
    """The tensor-parallel group when it has more than one rank, else None."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


def amax_reduction_group():
    """The group over which delayed-scaling amaxes are reduced: every rank of this pipeline stage (TP x DP x CP,
    `parallel_state.get_amax_reduction_group(with_context_parallel=True)`), or None when that is one rank or no
    model-parallel state exists. Transformer Engine's autocast gets the same group as its `fp8_group`."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_amax_reduction_group(with_context_parallel=True)
    return group if dist.get_world_size(group) > 1 else None


def amax_reduction_groups():
    """`[amax_reduction_group()]`, or `[]` when there is nothing to reduce over (the form the reductions take)."""
    group = amax_reduction_group()
    return [] if group is None else [group]


def all_reduce_max(tensor, groups):
    """In-place MAX over each group in turn (fp32 only: gloo cannot reduce float8)."""
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


class ScalingState:
    """The scale of one tensor role of one module.

    Args:
        recipe: the run's `Fp8Recipe`.
        dtype: the float8 dtype this role is stored in.
        sharded_over_tensor_parallel: the tensor is split across tensor-parallel ranks (so its amax is reduced
            over them); replicated tensors already agree.
    """

    def __init__(self, recipe: Fp8Recipe, dtype: torch.dtype, sharded_over_tensor_parallel: bool,
                 history_storage=None, count_storage=None):
        self.recipe = recipe
        self.dtype = dtype
        self.sharded_over_tensor_parallel = sharded_over_tensor_parallel
        # The history and its fill count may live in a module's buffers, so checkpoints carry them.
        if history_storage is None:
            history_storage = torch.zeros(recipe.amax_history_len, dtype=torch.float32)
        if history_storage.shape != (recipe.amax_history_len,):
            raise ValueError(f"amax history storage of shape {tuple(history_storage.shape)} for history length "
                             f"{recipe.amax_history_len}")
        self.amax_history = history_storage
        self.recorded_count = count_storage if count_storage is not None else torch.zeros(1, dtype=torch.int64)
        self.pending_amax = None

    @property
    def num_recorded(self) -> int:
        return int(self.recorded_count.item())

    # ---- scale selection --------------------------------------------------------------------------------------
    def _current_scale(self, tensor):
        current = amax(tensor).reshape(1)
        if self.sharded_over_tensor_parallel:
            all_reduce_max(current, [tensor_parallel_group_if_sharded()])
        return scale_from_amax(current[0], self.dtype, self.recipe.margin)

    def history_amax(self) -> torch.Tensor:
        if self.recipe.amax_compute_algo == "max":
            return self.amax_history.max()
        return self.amax_history[0]

    def scale_for(self, tensor: torch.Tensor) -> torch.Tensor:
        """The scale to quantize `tensor` with; under delayed scaling also records its amax."""
        if not self.recipe.is_delayed:
            return self._current_scale(tensor)
        local_amax = amax(tensor).cpu()
        self.pending_amax = local_amax if self.pending_amax is None else torch.maximum(self.pending_amax, local_amax)
        if self.num_recorded == 0:
            # No history yet (the first step): scale by the current amax rather than by an arbitrary 1.
            return self._current_scale(tensor)
        return scale_from_amax(self.history_amax().to(tensor.device), self.dtype, self.recipe.margin)

    def quantize(self, tensor: torch.Tensor) -> Float8Tensor:
        return quantize(tensor, self.dtype, self.scale_for(tensor))

    # ---- delayed scaling: history ------------------------------------------------------------------------------
    def take_pending_amax(self) -> float:
        pending = NO_AMAX if self.pending_amax is None else float(self.pending_amax)
        self.pending_amax = None
        return pending

    def record(self, reduced_amax: float):
        """Push an amax (already agreed across ranks) into the history, newest first."""
        with torch.no_grad():
            self.amax_history.copy_(torch.roll(self.amax_history, 1))
            self.amax_history[0] = reduced_amax
            self.recorded_count.add_(1)


def reduce_and_record_amaxes(states, groups):
    """Reduce the pending amaxes of `states` (same order on every rank) in one vector and record them."""
    if not states:
        return
    pending = torch.tensor([state.take_pending_amax() for state in states], dtype=torch.float32)
    if groups:
        from megatron.core.device_utils import get_device_for_group

        device = get_device_for_group(groups[0])
        pending = all_reduce_max(pending.to(device), groups).cpu()
    for state, value in zip(states, pending.tolist()):
        if value != NO_AMAX:
            state.record(value)


class LinearScaling:
    """The three scaling states of one FP8 linear layer.

    Column-parallel layers hold an output-feature shard of the weight and of the output gradient; row-parallel
    ones an input-feature shard of the input and of the weight.
    """

    ROLES = ("input", "weight", "grad_output")

    def __init__(self, recipe: Fp8Recipe, parallel_mode: str, history_storage=None, count_storage=None):
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

"""Optimizer state in the logical format: per logical parameter name, its fp32 main weights and moments.

Keys (named in `logical_names`): `optimizer.state.<logical name>.<state key>` (e.g. `exp_avg`, `exp_avg_sq`, and
`fp32_param` for the main weights of a parameter whose model copy is not fp32), `optimizer.step`,
`optimizer.param_groups` (hyperparameters, not parameters) and `optimizer.grad_scaler`. Every optimizer flavour describes its main
parameters as `MainParamEntry`s (which elements of which logical tensor a main tensor holds); the rest is shared.
"""

import sys
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from torch.distributed.tensor import DTensor

from megatron.core.dist_checkpointing.logical_names import (  # noqa: F401  (key names re-exported)
    GRAD_SCALER_KEY,
    MAIN_PARAM_KEY,
    PARAM_GROUPS_KEY,
    STATE_PREFIX,
    STEP_KEY,
    Placement,
    TensorParallelRank,
    current_tensor_parallel_rank,
    optimizer_state_keys_of,
    parameter_placements,
    state_key,
)
from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor
from megatron.core.dist_checkpointing.param_groups import saved_group_for_each
from megatron.core.distributed.data_parallel_base import unwrap_model


class MainParamEntry(NamedTuple):
    """`main` (the tensor the optimizer steps) holds elements `[start, end)` of the flattened local partition of
    shape `local_shape` (the whole partition when `flat_range` is None) of logical tensor `placement`."""

    main: torch.Tensor
    placement: Placement
    local_shape: Tuple[int, ...]
    flat_range: Optional[Tuple[int, int]]
    model_dtype: torch.dtype

    def pieces_of(self, tensor: torch.Tensor) -> ShardedLogicalTensor:
        """`tensor` (aligned with `main`) as pieces of the logical tensor."""
        offsets = self.placement.offsets(self.local_shape)
        if self.flat_range is None:  # a whole TP partition (plain, or a DTensor sharded over DP by FSDP2)
            local = tensor if isinstance(tensor, DTensor) else tensor.view(self.local_shape)
            return ShardedLogicalTensor.from_local(local, self.placement.global_shape, offsets)
        return ShardedLogicalTensor.from_flat_range(tensor, self.placement.global_shape, self.local_shape, offsets,
                                                    *self.flat_range)


def is_optimizer_of_class(optimizer, class_name: str) -> bool:
    """isinstance(optimizer, megatron.core.optimizer.<class_name>), found without importing the optimizers (they
    checkpoint through this package): an optimizer exists only once its module has been imported."""
    optimizers = sys.modules.get("megatron.core.optimizer")
    optimizer_class = getattr(optimizers, class_name, None)
    return optimizer_class is not None and isinstance(optimizer, optimizer_class)


def main_param_entries(optimizer, model_chunks, tp: Optional[TensorParallelRank] = None) -> List[MainParamEntry]:
    """The main parameters of a Megatron optimizer (FP32, Float16 or Distributed) and where they sit."""
    tp = tp or current_tensor_parallel_rank()
    placements = {}
    for chunk in model_chunks:
        placements.update(parameter_placements(unwrap_model(chunk), tp))
    if is_optimizer_of_class(optimizer, "DistributedOptimizer"):
        return [MainParamEntry(shard.main_param, placements[shard.model_param], tuple(shard.model_param.shape),
                               (shard.param_start, shard.param_end), shard.model_param.dtype)
                for shard in optimizer._shards]
    if is_optimizer_of_class(optimizer, "Float16Optimizer"):
        pairs = optimizer._model_and_main
    elif is_optimizer_of_class(optimizer, "FP32Optimizer"):
        pairs = [(param, param) for param in optimizer.main_params()]
    else:
        raise NotImplementedError(f"no logical checkpoint layout for optimizer {type(optimizer).__name__}")
    return [MainParamEntry(main, placements[model], tuple(model.shape), None, model.dtype) for model, main in pairs]


def _global_step(optimizer) -> Optional[float]:
    """The step counter, agreed over all ranks (a rank owning no elements has none)."""
    steps = [float(state["step"]) for state in optimizer.optimizer.state.values() if "step" in state]
    local = max(steps) if steps else -1.0
    if dist.is_initialized() and dist.get_world_size() > 1:
        device = optimizer._device() if hasattr(optimizer, "_device") else torch.device("cpu")
        value = torch.tensor([local], dtype=torch.float64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        local = value.item()
    return None if local < 0 else local


def _hyperparameters(optimizer):
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def optimizer_state_to_save(optimizer, entries: List[MainParamEntry], include_tied_copies: bool = False
                            ) -> Dict[str, object]:
    """The logical optimizer state of this rank (collective: agrees on the step counter); tied copies that
    another stage saves only with `include_tied_copies`."""
    state = {STEP_KEY: _global_step(optimizer), PARAM_GROUPS_KEY: _hyperparameters(optimizer),
             GRAD_SCALER_KEY: None if optimizer.grad_scaler is None else optimizer.grad_scaler.state_dict()}
    torch_state = optimizer.optimizer.state
    for entry in entries:
        if not (entry.placement.saved_here or include_tied_copies):
            continue
        name = entry.placement.logical_name
        if entry.model_dtype != torch.float32:
            state[state_key(name, MAIN_PARAM_KEY)] = entry.pieces_of(entry.main.detach())
        for key, value in torch_state.get(entry.main, {}).items():
            if torch.is_tensor(value) and value.shape == entry.main.shape and value.dim() > 0:
                value = state_value(optimizer.optimizer, entry.main, key, value)
                state[state_key(name, key)] = entry.pieces_of(value.detach())
    return state


def state_value(torch_optimizer, param, key, stored):
    """The value of `param`'s state tensor `key`: Adam moments that an optimizer stores scaled (TE's FusedAdam,
    the precision-aware AdamW with fp16 moments) come unscaled through its `get_unscaled_state`."""
    get_unscaled_state = getattr(torch_optimizer, "get_unscaled_state", None)
    if get_unscaled_state is None or key not in ("exp_avg", "exp_avg_sq"):
        return stored
    return get_unscaled_state(param, key)


def optimizer_load_targets(entries: List[MainParamEntry], saved_keys) -> Tuple[Dict[str, object], list]:
    """(targets to load into, what to install afterwards).

    Targets are fresh tensors for the moments and the main parameters themselves for `fp32_param`; the second
    item lists `(entry, {state key: tensor})` for `install_optimizer_state`.
    """
    targets, installs = {}, []
    for entry in entries:
        name = entry.placement.logical_name
        moments = {}
        for key in optimizer_state_keys_of(name, saved_keys):
            if key == MAIN_PARAM_KEY:
                targets[state_key(name, key)] = entry.pieces_of(entry.main.data)
                continue
            moments[key] = torch.zeros_like(entry.main.detach(), dtype=torch.float32)
            targets[state_key(name, key)] = entry.pieces_of(moments[key])
        installs.append((entry, moments))
    return targets, installs


def install_optimizer_state(optimizer, installs, step, param_groups, grad_scaler_state):
    """Put loaded moments and the step counter into the torch optimizer, and restore hyperparameters: each
    group's from the saved group of the same identity (see `param_groups`). Returns the indices of the groups
    the checkpoint has none for, which keep this run's."""
    torch_optimizer = optimizer.optimizer
    on_device = bool(torch_optimizer.defaults.get("fused") or torch_optimizer.defaults.get("capturable"))
    for entry, moments in installs:
        state = torch_optimizer.state[entry.main]
        state.update(moments)
        if step is not None and moments:
            state["step"] = torch.tensor(float(step), dtype=torch.float32,
                                         device=entry.main.device if on_device else "cpu")
    unmatched = []
    if param_groups is not None:
        kept = getattr(torch_optimizer, "settings_from_flags", ())  # Muon's: set by this run's flags
        matches = saved_group_for_each(torch_optimizer.param_groups, param_groups)
        for index, (group, saved_index) in enumerate(zip(torch_optimizer.param_groups, matches)):
            if saved_index is None:
                unmatched.append(index)
                continue
            group.update({key: value for key, value in param_groups[saved_index].items() if key not in kept})
    if optimizer.grad_scaler is not None and grad_scaler_state is not None:
        optimizer.grad_scaler.load_state_dict(grad_scaler_state)
    return unmatched

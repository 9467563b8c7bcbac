"""Optimizer state in the logical format: per logical parameter name, its fp32 main weights and moments.

Keys: `optimizer.state.<logical name>.<state key>` (e.g. `exp_avg`, `exp_avg_sq`, and `fp32_param` for the
main weights of a parameter whose model copy is not fp32), `optimizer.step`, `optimizer.param_groups`
(hyperparameters, not parameters) and `optimizer.grad_scaler`. Every optimizer flavour describes its main
parameters as `MainParamEntry`s (which elements of which logical tensor a main tensor holds); the rest is shared.
"""

from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from torch.distributed.tensor import DTensor

from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor, flat_range_pieces
from megatron.core.dist_checkpointing.model_state import (
    Placement,
    TensorParallelRank,
    current_tensor_parallel_rank,
    local_piece,
    parameter_placements,
    unwrap_model,
)

STATE_PREFIX = "optimizer.state."
MAIN_PARAM_KEY = "fp32_param"
STEP_KEY = "optimizer.step"
PARAM_GROUPS_KEY = "optimizer.param_groups"
GRAD_SCALER_KEY = "optimizer.grad_scaler"


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
        if self.flat_range is None:  # a whole TP partition (plain, or a DTensor sharded over DP by FSDP2)
            return local_piece(self.placement, tensor if isinstance(tensor, DTensor) else tensor.view(self.local_shape))
        offsets = self.placement.offsets(self.local_shape)
        pieces = flat_range_pieces(tensor.view(-1), self.local_shape, offsets, *self.flat_range)
        return ShardedLogicalTensor(self.placement.global_shape, pieces, dtype=tensor.dtype)


def state_key(logical_name: str, key: str) -> str:
    return f"{STATE_PREFIX}{logical_name}.{key}"


def main_param_entries(optimizer, model_chunks, tp: Optional[TensorParallelRank] = None) -> List[MainParamEntry]:
    """The main parameters of a Megatron optimizer (FP32, Float16 or Distributed) and where they sit."""
    tp = tp or current_tensor_parallel_rank()
    placements = {}
    for chunk in model_chunks:
        placements.update(parameter_placements(unwrap_model(chunk), tp))
    kind = type(optimizer).__name__
    if kind == "DistributedOptimizer":
        return [MainParamEntry(shard.main_param, placements[shard.model_param], tuple(shard.model_param.shape),
                               (shard.param_start, shard.param_end), shard.model_param.dtype)
                for shard in optimizer._shards]
    if kind == "Float16Optimizer":
        pairs = optimizer._model_and_main
    elif kind == "FP32Optimizer":
        pairs = [(param, param) for param in optimizer.main_params()]
    else:
        raise NotImplementedError(f"no logical checkpoint layout for optimizer {kind}")
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


def optimizer_state_to_save(optimizer, entries: List[MainParamEntry]) -> Dict[str, object]:
    """The logical optimizer state of this rank (collective: agrees on the step counter)."""
    state = {STEP_KEY: _global_step(optimizer), PARAM_GROUPS_KEY: _hyperparameters(optimizer),
             GRAD_SCALER_KEY: None if optimizer.grad_scaler is None else optimizer.grad_scaler.state_dict()}
    torch_state = optimizer.optimizer.state
    for entry in entries:
        if not entry.placement.saved_here:
            continue
        name = entry.placement.logical_name
        if entry.model_dtype != torch.float32:
            state[state_key(name, MAIN_PARAM_KEY)] = entry.pieces_of(entry.main.detach())
        for key, value in torch_state.get(entry.main, {}).items():
            if torch.is_tensor(value) and value.shape == entry.main.shape and value.dim() > 0:
                state[state_key(name, key)] = entry.pieces_of(value.detach())
    return state


def optimizer_state_keys_of(name: str, saved_keys) -> List[str]:
    """The per-parameter state keys (`exp_avg`, ...) the checkpoint has for logical tensor `name`."""
    prefix = f"{STATE_PREFIX}{name}."
    return [key[len(prefix):] for key in saved_keys if key.startswith(prefix) and "." not in key[len(prefix):]]


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
    """Put loaded moments and the step counter into the torch optimizer, and restore hyperparameters."""
    torch_optimizer = optimizer.optimizer
    on_device = bool(torch_optimizer.defaults.get("fused") or torch_optimizer.defaults.get("capturable"))
    for entry, moments in installs:
        state = torch_optimizer.state[entry.main]
        state.update(moments)
        if step is not None and moments:
            state["step"] = torch.tensor(float(step), dtype=torch.float32,
                                         device=entry.main.device if on_device else "cpu")
    if param_groups is not None and len(param_groups) == len(torch_optimizer.param_groups):
        for group, saved in zip(torch_optimizer.param_groups, param_groups):
            group.update(saved)
    if optimizer.grad_scaler is not None and grad_scaler_state is not None:
        optimizer.grad_scaler.load_state_dict(grad_scaler_state)

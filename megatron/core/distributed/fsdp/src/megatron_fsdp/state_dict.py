"""Model and optimizer state dicts of a MegatronFSDP model as row-sharded DTensors (see uneven_dtensor.py).

Saving gathers one group at a time (its flat shards -> the full flat group, transiently) and keeps only this
rank's rows. Loading writes this rank's rows into a zeroed full flat group and sums over the data-parallel
group (every element is written by exactly one rank), then keeps this rank's flat shard.

With tensor parallelism a parameter's rows are those of this rank's TP partition, and its DTensor has the full,
unpartitioned shape (see uneven_dtensor.py); loading cuts full values down to the partition first.
"""

from typing import Dict, List

import torch
from torch.distributed.tensor import DTensor

from . import collectives
from .distributed_data_parallel_config import ShardingStrategy
from .optimizer_state import initialize_optimizer_state
from .param_and_grad_buffer import ParamGroup
from .uneven_dtensor import (
    local_rows_of,
    make_row_sharded_dtensor,
    row_range,
    row_slice_of_flat,
    tensor_parallel_full_shape,
    tensor_parallel_partition_of,
)

# Optimizer-state key of the main weights, saved when they are kept in another dtype than the compute weights
# (the model state dict holds the compute dtype, so the main weights would otherwise come back rounded).
MAIN_PARAM_KEY = "main_param"


def _tp_partition_dim(model, param):
    """The dim along which `param` holds its tensor-parallel partition, or None if it is replicated over TP
    (Megatron-Core's TP layers mark partitioned parameters; read with getattr to stay free of megatron.core)."""
    if model.topology.tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return None
    return getattr(param, "partition_dim") % param.dim()


def _check_checkpointable(model):
    if model.topology.tp_size == 1:
        return
    for group in model.groups:
        for name, param in zip(group.names, group.params):
            if _tp_partition_dim(model, param) is not None and getattr(param, "partition_stride", 1) != 1:
                raise NotImplementedError(
                    f"parameter '{name}' has partition_stride={param.partition_stride}: strided tensor-parallel "
                    "partitions have no DTensor placement here; build the layer with stride=1 to checkpoint it")


def _tensor_parallel_local_values(model, group: ParamGroup, values) -> list:
    """Checkpoint values of the full (TP-unpartitioned) shape -> values of this rank's TP partitions (zeros for
    a missing value, None)."""
    topology = model.topology
    return [torch.zeros(span.shape) if value is None else
            tensor_parallel_partition_of(value, span.shape, _tp_partition_dim(model, param), topology.tp_size,
                                         topology.tp_rank, topology.dp_size, topology.dp_rank)
            for value, span, param in zip(values, group.layout.spans, group.params)]


def _in_outer_sub_shards(group: ParamGroup) -> bool:
    """Whether a trainable group's main weights, optimizer gradients and state are HFSDP sub-shards. Pieces
    and loaded values of groups with main weights are at that level; those of frozen groups are compute shards."""
    return group.outer_sharded and group.main_weights is not None


def _full_flat(model, group: ParamGroup, pieces: List[torch.Tensor]) -> torch.Tensor:
    """The full flat group from per-parameter local pieces (flat shard pieces, HFSDP sub-shard pieces of the
    main weights / optimizer state, or whole params for no_shard)."""
    layout = group.layout
    if model.strategy == ShardingStrategy.no_shard:
        return torch.cat([piece.reshape(-1) for piece in pieces]) if pieces else torch.empty(0)
    dtype = pieces[0].dtype if pieces else group.main_dtype
    sub_shards = _in_outer_sub_shards(group)
    local = torch.zeros(layout.sub_shard_numel if sub_shards else layout.shard_numel, dtype=dtype,
                        device=group.device)
    for piece_range, piece in zip(group.main_pieces if sub_shards else group.pieces, pieces):
        local[piece_range.shard_start:piece_range.shard_end].copy_(piece.reshape(-1))
    uncounted = collectives.CommunicationCounter()
    if sub_shards:  # sub-shards -> shard over the outer group, then shards -> group as usual
        shard = torch.empty(layout.shard_numel, dtype=dtype, device=group.device)
        collectives.all_gather_flat(shard, local, model.topology.outer_group, uncounted)
        local = shard
    full = torch.empty(layout.padded_numel, dtype=dtype, device=group.device)
    collectives.all_gather_flat(full, local, model.topology.dp_group, uncounted)
    return full


def _row_dtensors(model, group: ParamGroup, pieces: List[torch.Tensor], dtype=None) -> List[DTensor]:
    """One DTensor of the full (TP-unpartitioned) shape per parameter, holding this rank's rows of its
    (partition of the) parameter."""
    mesh, dp_mesh_dim, tp_mesh_dim = model.topology.checkpoint_mesh()
    full = _full_flat(model, group, pieces)
    if dtype is not None:
        full = full.to(dtype)
    result = []
    for span, param in zip(group.layout.spans, group.params):
        flat = full[span.flat_start:span.flat_end]
        rows = row_slice_of_flat(flat, span.shape, model.topology.dp_size, model.topology.dp_rank).clone()
        partition_dim = _tp_partition_dim(model, param)
        shape = tensor_parallel_full_shape(span.shape, partition_dim, model.topology.tp_size)
        result.append(make_row_sharded_dtensor(rows, shape, mesh, dp_mesh_dim, tp_mesh_dim, partition_dim))
    return result


def _weight_pieces(group: ParamGroup) -> List[torch.Tensor]:
    if group.main_weights is not None:
        return list(group.main_param_views)
    source = group.compute_shard if group.shards_params else group.compute_buffer
    if group.strategy == ShardingStrategy.no_shard:
        return [group.param_view(i) for i in range(len(group.params))]
    if not group.shards_params:
        source = group.compute_buffer_shard
    return [source[p.shard_start:p.shard_end] for p in group.pieces]


def module_state_keys(module) -> List[tuple]:
    """(key, kind, canonical name) for every entry `module.state_dict()` holds, in its order: each parameter
    under every name a module gives it (tied aliases included), then persistent buffers. `canonical name` is
    the name `named_parameters()` / `named_buffers()` (which drop aliases) report for the same tensor."""
    canonical = {}
    for name, param in module.named_parameters():
        canonical[id(param)] = name
    for name, buffer in module.named_buffers():
        canonical[id(buffer)] = name
    keys = []
    for prefix, submodule in module.named_modules(remove_duplicate=False):
        prefix = f"{prefix}." if prefix else ""
        for name, param in submodule._parameters.items():
            if param is not None:
                keys.append((prefix + name, "param", canonical[id(param)]))
        for name, buffer in submodule._buffers.items():
            if buffer is not None and name not in submodule._non_persistent_buffers_set:
                keys.append((prefix + name, "buffer", canonical[id(buffer)]))
    return keys


def model_state_dict(model) -> Dict[str, object]:
    """Keys equal `model.module.state_dict()`'s; a tied parameter's aliases map to the same DTensor."""
    _check_checkpointable(model)
    model.schedule.wait_gathered(model.groups)
    params = {}
    for group in model.groups:
        for name, tensor in zip(group.names, _row_dtensors(model, group, _weight_pieces(group), group.param_dtype)):
            params[name] = tensor
    buffers = {name: buffer.detach().clone() for name, buffer in model.module.named_buffers()}
    state = {}
    for key, kind, canonical in module_state_keys(model.module):
        state[key] = params[canonical] if kind == "param" else buffers[canonical]
    return state


def _shard_from_rows(model, group: ParamGroup, values: List[torch.Tensor], dtype, full_group=False) -> torch.Tensor:
    """Rows of every parameter (this rank's) -> this rank's flat shard (or the full flat group for no_shard);
    for HFSDP main weights and optimizer state, this rank's sub-shard of it."""
    topology = model.topology
    full = torch.zeros(group.layout.padded_numel, dtype=dtype, device=group.device)
    for span, value in zip(group.layout.spans, values):
        rows = local_rows_of(value, span.shape, topology.dp_size, topology.dp_rank).to(device=group.device,
                                                                                       dtype=dtype)
        start, end = row_range(span.shape, topology.dp_size, topology.dp_rank)
        row_numel = (span.numel // span.shape[0]) if (span.shape and span.shape[0]) else span.numel
        full[span.flat_start + start * row_numel:span.flat_start + end * row_numel].copy_(rows.reshape(-1))
    collectives.all_reduce_scalar_sum(full, topology.dp_group)
    if full_group or model.strategy == ShardingStrategy.no_shard:
        return full
    if _in_outer_sub_shards(group):
        start, end = group.layout.sub_shard_range(topology.dp_rank, group.outer_rank)
        return full[start:end]
    shard_start, shard_end = group.layout.shard_range(topology.dp_rank)
    return full[shard_start:shard_end]


def load_model_state_dict(model, state_dict, strict: bool = True):
    _check_checkpointable(model)
    model.schedule.wait_gathered(model.groups)
    # A tied parameter may come under any of its names (a plain module's state dict holds them all).
    aliases = {}
    for key, _, canonical in module_state_keys(model.module):
        aliases.setdefault(canonical, []).append(key)
    state_dict = dict(state_dict)
    for canonical, keys in aliases.items():
        present = [key for key in keys if key in state_dict]
        if present and canonical not in state_dict:
            state_dict[canonical] = state_dict[present[0]]
    missing = sorted(key for keys in aliases.values() for key in keys if not any(k in state_dict for k in keys))
    unexpected = sorted(set(state_dict) - {key for keys in aliases.values() for key in keys})
    if strict and (missing or unexpected):
        raise RuntimeError(f"MegatronFSDP.load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    buffers = dict(model.module.named_buffers())
    with torch.no_grad():
        for group in model.groups:
            if any(name not in state_dict for name in group.names):
                continue
            dtype = group.main_dtype if group.main_weights is not None else group.param_dtype
            # Frozen groups of strategies 0-2 are never re-gathered, so they take the whole group at once.
            full_group = group.main_weights is None and not group.shards_params
            values = _tensor_parallel_local_values(model, group, [state_dict[name] for name in group.names])
            values = _shard_from_rows(model, group, values, dtype, full_group)
            if group.main_weights is not None:
                group.main_weights.copy_(values)
                group.install_main_into_compute()
            elif group.shards_params:
                group.compute_shard.copy_(values)
            else:
                group.compute_buffer.copy_(values)
        for name, buffer in buffers.items():
            if name in state_dict:
                value = state_dict[name]
                buffer.copy_(value.full_tensor() if isinstance(value, DTensor) else value)
    if model.strategy in (ShardingStrategy.optim, ShardingStrategy.optim_grads):
        model.schedule.start_param_sync(async_op=False)
    elif model.strategy == ShardingStrategy.optim_grads_params:
        for group in model.groups:
            if group.gathered:
                group.gathered = False
                model.schedule.ensure_gathered([group])
    return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


# ---- optimizer --------------------------------------------------------------------------------------------------
def _optimizer_params_by_name(optimizer):
    model = optimizer._megatron_fsdp_model
    by_name = {}
    for group in model.groups:
        for index, name in enumerate(group.names):
            if group.main_weights is not None:
                by_name[name] = (group, index)
    return model, by_name


def _is_sharded_state(value, view) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == view.shape


def optimizer_state_dict(optimizer) -> dict:
    """{"state": {param name: {key: DTensor or scalar}}, "param_groups": [{hyper-params, "params": [names]}]}."""

    model, by_name = _optimizer_params_by_name(optimizer)
    _check_checkpointable(model)
    initialize_optimizer_state(optimizer)
    names = optimizer._megatron_fsdp_param_names
    state = {}
    for group in model.groups:
        if group.main_weights is None:
            continue
        views = group.main_param_views
        keys = set()
        for view in views:
            keys.update(k for k, v in optimizer.state.get(view, {}).items() if _is_sharded_state(v, view))
        for key in sorted(keys):
            pieces = [optimizer.state[view][key] if key in optimizer.state.get(view, {}) else torch.zeros_like(view)
                      for view in views]
            for index, tensor in enumerate(_row_dtensors(model, group, pieces)):
                if views[index] in optimizer.state:
                    state.setdefault(group.names[index], {})[key] = tensor
        if group.main_dtype != group.param_dtype:
            for index, tensor in enumerate(_row_dtensors(model, group, list(views))):
                state.setdefault(group.names[index], {})[MAIN_PARAM_KEY] = tensor
        for index, view in enumerate(views):
            for key, value in optimizer.state.get(view, {}).items():
                if not _is_sharded_state(value, view):
                    state.setdefault(group.names[index], {})[key] = value.clone() if isinstance(
                        value, torch.Tensor) else value
    param_groups = []
    for param_group in optimizer.param_groups:
        entry = {k: v for k, v in param_group.items() if k != "params"}
        entry["params"] = [names[id(p)] for p in param_group["params"]]
        param_groups.append(entry)
    return {"state": state, "param_groups": param_groups}


def load_optimizer_state_dict(optimizer, state_dict):
    """Accepts the name-keyed form (DTensor or full-tensor states) or torch's own index-keyed form of the
    sharded optimizer (as saved by `torch.optim.Optimizer.state_dict` at the same data-parallel size).

    Main weights saved under MAIN_PARAM_KEY replace those the model state dict set (in the compute dtype), so
    load the model state first and the optimizer state second."""
    groups_in = state_dict["param_groups"]
    if groups_in and groups_in[0]["params"] and not isinstance(groups_in[0]["params"][0], str):
        return optimizer._megatron_fsdp_original_load_state_dict(state_dict)

    model, by_name = _optimizer_params_by_name(optimizer)
    _check_checkpointable(model)
    initialize_optimizer_state(optimizer)
    if len(groups_in) != len(optimizer.param_groups):
        raise ValueError(f"optimizer state dict has {len(groups_in)} param groups, the optimizer has "
                         f"{len(optimizer.param_groups)}")
    for saved, current in zip(groups_in, optimizer.param_groups):
        current.update({k: v for k, v in saved.items() if k != "params"})
    saved_state = state_dict["state"]
    main_weights_loaded = False
    with torch.no_grad():
        for group in model.groups:
            if group.main_weights is None or not any(name in saved_state for name in group.names):
                continue
            if all(MAIN_PARAM_KEY in saved_state.get(name, {}) for name in group.names):
                values = _tensor_parallel_local_values(model, group,
                                                       [saved_state[name][MAIN_PARAM_KEY] for name in group.names])
                group.main_weights.copy_(_shard_from_rows(model, group, values, group.main_dtype))
                main_weights_loaded = True
            keys = set()
            for name in group.names:
                keys.update(k for k, v in saved_state.get(name, {}).items()
                            if isinstance(v, torch.Tensor) and v.dim() > 0 and k != MAIN_PARAM_KEY)
            for key in sorted(keys):
                values = _tensor_parallel_local_values(
                    model, group, [saved_state.get(name, {}).get(key) for name in group.names])
                flat = _shard_from_rows(model, group, values, group.main_dtype)
                for index, view in enumerate(group.main_param_views):
                    target = group._main_view(flat, index)
                    optimizer.state[view][key] = target.clone()
            for index, name in enumerate(group.names):
                for key, value in saved_state.get(name, {}).items():
                    if not (isinstance(value, torch.Tensor) and value.dim() > 0):
                        view = group.main_param_views[index]
                        if isinstance(value, DTensor):
                            value = value.full_tensor()
                        optimizer.state[view][key] = value.clone() if isinstance(value, torch.Tensor) else value
    if main_weights_loaded:
        model.install_optimized_model_weights()
        model.schedule.wait_gathered(model.groups)

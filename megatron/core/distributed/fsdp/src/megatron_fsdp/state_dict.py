"""Model and optimizer state dicts of a MegatronFSDP model as row-sharded DTensors (see uneven_dtensor.py).

Saving gathers one group at a time (its flat shards -> the full flat group, transiently) and keeps only this
rank's rows. Loading writes this rank's rows into a zeroed full flat group and sums over the data-parallel
group (every element is written by exactly one rank), then keeps this rank's flat shard.
"""

from typing import Dict, List

import torch
from torch.distributed.tensor import DTensor

from . import collectives
from .distributed_data_parallel_config import ShardingStrategy
from .param_and_grad_buffer import ParamGroup
from .uneven_dtensor import local_rows_of, make_row_sharded_dtensor, row_range, row_slice_of_flat


def _check_checkpointable(model):
    if model.topology.tp_size > 1:
        raise NotImplementedError("DTensor state dicts of tensor-parallel parameters (tp_dim with size > 1) "
                                  "are not implemented; save per TP rank instead")


def _full_flat(model, group: ParamGroup, pieces: List[torch.Tensor]) -> torch.Tensor:
    """The full flat group from per-parameter local pieces (flat shard pieces, or whole params for no_shard)."""
    layout = group.layout
    if model.strategy == ShardingStrategy.no_shard:
        return torch.cat([piece.reshape(-1) for piece in pieces]) if pieces else torch.empty(0)
    dtype = pieces[0].dtype if pieces else group.main_dtype
    shard = torch.zeros(layout.shard_numel, dtype=dtype, device=group.device)
    for piece_range, piece in zip(group.pieces, pieces):
        shard[piece_range.shard_start:piece_range.shard_end].copy_(piece.reshape(-1))
    full = torch.empty(layout.padded_numel, dtype=dtype, device=group.device)
    collectives.all_gather_flat(full, shard, model.topology.dp_group, collectives.CommunicationCounter())
    return full


def _row_dtensors(model, group: ParamGroup, pieces: List[torch.Tensor], dtype=None) -> List[DTensor]:
    mesh, shard_dim = model.topology.checkpoint_mesh()
    full = _full_flat(model, group, pieces)
    if dtype is not None:
        full = full.to(dtype)
    result = []
    for index, span in enumerate(group.layout.spans):
        flat = full[span.flat_start:span.flat_end]
        rows = row_slice_of_flat(flat, span.shape, model.topology.dp_size, model.topology.dp_rank).clone()
        result.append(make_row_sharded_dtensor(rows, span.shape, mesh, shard_dim))
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


def model_state_dict(model) -> Dict[str, object]:
    _check_checkpointable(model)
    model.schedule.wait_gathered(model.groups)
    state = {}
    for group in model.groups:
        for name, tensor in zip(group.names, _row_dtensors(model, group, _weight_pieces(group), group.param_dtype)):
            state[name] = tensor
    for name, buffer in model.module.named_buffers():
        state[name] = buffer.detach().clone()
    return state


def _shard_from_rows(model, group: ParamGroup, values: List[torch.Tensor], dtype, full_group=False) -> torch.Tensor:
    """Rows of every parameter (this rank's) -> this rank's flat shard (or the full flat group for no_shard)."""
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
    shard_start, shard_end = group.layout.shard_range(topology.dp_rank)
    return full[shard_start:shard_end]


def load_model_state_dict(model, state_dict, strict: bool = True):
    _check_checkpointable(model)
    model.schedule.wait_gathered(model.groups)
    expected = {name for group in model.groups for name in group.names}
    buffers = dict(model.module.named_buffers())
    missing = sorted((expected | set(buffers)) - set(state_dict))
    unexpected = sorted(set(state_dict) - expected - set(buffers))
    if strict and (missing or unexpected):
        raise RuntimeError(f"MegatronFSDP.load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    with torch.no_grad():
        for group in model.groups:
            if any(name not in state_dict for name in group.names):
                continue
            dtype = group.main_dtype if group.main_weights is not None else group.param_dtype
            # Frozen groups of strategies 0-2 are never re-gathered, so they take the whole group at once.
            full_group = group.main_weights is None and not group.shards_params
            values = _shard_from_rows(model, group, [state_dict[name] for name in group.names], dtype, full_group)
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
    from .optimizer import initialize_optimizer_state

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
    sharded optimizer (as saved by `torch.optim.Optimizer.state_dict` at the same data-parallel size)."""
    groups_in = state_dict["param_groups"]
    if groups_in and groups_in[0]["params"] and not isinstance(groups_in[0]["params"][0], str):
        return optimizer._megatron_fsdp_original_load_state_dict(state_dict)
    from .optimizer import initialize_optimizer_state

    model, by_name = _optimizer_params_by_name(optimizer)
    _check_checkpointable(model)
    initialize_optimizer_state(optimizer)
    if len(groups_in) != len(optimizer.param_groups):
        raise ValueError(f"optimizer state dict has {len(groups_in)} param groups, the optimizer has "
                         f"{len(optimizer.param_groups)}")
    for saved, current in zip(groups_in, optimizer.param_groups):
        current.update({k: v for k, v in saved.items() if k != "params"})
    saved_state = state_dict["state"]
    with torch.no_grad():
        for group in model.groups:
            if group.main_weights is None or not any(name in saved_state for name in group.names):
                continue
            keys = set()
            for name in group.names:
                keys.update(k for k, v in saved_state.get(name, {}).items()
                            if isinstance(v, torch.Tensor) and v.dim() > 0)
            for key in sorted(keys):
                values = [saved_state.get(name, {}).get(key, torch.zeros(span.shape))
                          for name, span in zip(group.names, group.layout.spans)]
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

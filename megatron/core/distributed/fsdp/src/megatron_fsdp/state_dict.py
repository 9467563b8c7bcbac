"""Model and optimizer state dicts of a MegatronFSDP model as row-sharded DTensors (see uneven_dtensor.py).

The row-aligned layout (layout.py) keeps each rank's rows of every parameter contiguous in its shard, which
is exactly what a state-dict DTensor (`Shard(0)` rows) holds: saving hands out views of those rows and loading
writes the rows into the shard, without communication. Two exceptions gather: HFSDP's optimizer side (main
weights and optimizer state are flat sub-shards of the rows, all-gathered over the outer group), and groups
whose full compute weights are written on load (strategy 0, frozen groups of strategies 1/2). A 0-dim
parameter lives on rank 0 only; its (replicated) value comes from the full weights (model state of strategies
0-2) or from replicas kept on every rank (`refresh_scalar_replicas`, `refresh_optimizer_scalar_replicas`), so
that `model.state_dict()` and `optimizer.state_dict()` issue no collective; stale replicas are summed over the
data-parallel group again.

Each group's rows are those of its shard ranks (`group.topology`): expert groups' DTensors live on the expert
data-parallel mesh, so an expert tensor's rows are spread over the ranks holding that expert.

With tensor parallelism a parameter's rows are those of this rank's TP partition, and its DTensor has the full,
unpartitioned shape (see uneven_dtensor.py); loading cuts full values down to the partition first.
"""

import weakref
from typing import Dict, List, Optional

import torch
from torch.distributed.tensor import DTensor

from . import collectives
from .distributed_data_parallel_config import ShardingStrategy
from .optimizer_state import initialize_optimizer_state
from .param_and_grad_buffer import ParamGroup
from .resharding import copy_gathered_to_unsharded
from .uneven_dtensor import (
    local_rows_of,
    make_row_sharded_dtensor,
    tensor_parallel_full_shape,
    tensor_parallel_partition_of,
)

# The child name torch's `checkpoint_wrapper` gives the module it wraps; torch leaves it out of state-dict keys
# (the wrapper's state-dict hooks strip it, and torch.distributed.checkpoint's FQNs drop it), so ours do too.
CHECKPOINT_WRAPPER_PREFIX = "_checkpoint_wrapped_module."


def state_dict_name(name: str) -> str:
    """The state-dict key of a parameter or buffer named `name` by `named_parameters()` / `named_buffers()`."""
    return name.replace(CHECKPOINT_WRAPPER_PREFIX, "")


# Optimizer-state key of the main weights, saved when they are kept in another dtype than the compute weights
# (the model state dict holds the compute dtype, so the main weights would otherwise come back rounded).
MAIN_PARAM_KEY = "main_param"


def _tp_partition_dim(group: ParamGroup, param):
    """The dim along which `param` holds its tensor-parallel partition, or None if it is replicated over its
    group's TP ranks (Megatron-Core's TP layers mark partitioned parameters, also at size 1; read with getattr to
    stay free of megatron.core). An expert group's TP size is the expert tensor-parallel size, not the model's."""
    if group.topology.tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return None
    return getattr(param, "partition_dim") % param.dim()


def _check_checkpointable(model):
    for group in model.groups:
        for name, param in zip(group.names, group.params):
            if _tp_partition_dim(group, param) is not None and getattr(param, "partition_stride", 1) != 1:
                raise NotImplementedError(
                    f"parameter '{name}' has partition_stride={param.partition_stride}: strided tensor-parallel "
                    "partitions have no DTensor placement here; build the layer with stride=1 to checkpoint it")


def _tensor_parallel_local_values(model, group: ParamGroup, values) -> list:
    """Checkpoint values of the full (TP-unpartitioned) shape -> values of this rank's TP partitions (zeros for
    a missing value, None)."""
    topology = group.topology
    return [torch.zeros(span.shape) if value is None else
            tensor_parallel_partition_of(value, span.shape, _tp_partition_dim(group, param), topology.tp_size,
                                         topology.tp_rank, topology.dp_size, topology.dp_rank)
            for value, span, param in zip(values, group.layout.spans, group.params)]


def _in_outer_sub_shards(group: ParamGroup) -> bool:
    """Whether a trainable group's main weights, optimizer gradients and state are HFSDP sub-shards. Pieces
    and loaded values of groups with main weights are at that level; those of frozen groups are compute shards."""
    return group.outer_sharded and group.main_weights is not None


def _shard_of_pieces(model, group: ParamGroup, pieces: List[torch.Tensor]) -> torch.Tensor:
    """This rank's whole shard from per-parameter main-level pieces (its rows, or under HFSDP the part of them
    in this outer rank's sub-shard, all-gathered over the outer group)."""
    layout = group.layout
    dtype = pieces[0].dtype if pieces else group.main_dtype
    sub_shards = _in_outer_sub_shards(group)
    local = torch.zeros(layout.sub_shard_numel if sub_shards else layout.shard_numel, dtype=dtype,
                        device=group.device)
    for piece_range, piece in zip(group.main_pieces if sub_shards else group.pieces, pieces):
        local[piece_range.shard_start:piece_range.shard_end].copy_(piece.reshape(-1))
    if not sub_shards:
        return local
    shard = torch.empty(layout.shard_numel, dtype=dtype, device=group.device)
    collectives.all_gather_flat(shard, local, group.topology.outer_group, collectives.CommunicationCounter())
    return shard


def _unsharded_of_shard(model, group: ParamGroup, shard: torch.Tensor) -> torch.Tensor:
    """The full group in its unsharded (param-major) form from every rank's shard (one all-gather)."""
    layout = group.layout
    gathered = torch.empty(layout.padded_numel, dtype=shard.dtype, device=shard.device)
    collectives.all_gather_flat(gathered, shard, group.topology.dp_group, collectives.CommunicationCounter())
    unsharded = torch.zeros_like(gathered)
    copy_gathered_to_unsharded(layout, gathered, unsharded)
    return unsharded


def _full_flat(model, group: ParamGroup, pieces: List[torch.Tensor]) -> torch.Tensor:
    """The full group in its unsharded form (`group.layout.spans` index it) from per-parameter local pieces
    (main-level pieces as the optimizer sees them, or whole parameters for no_shard). Collective."""
    if model.strategy == ShardingStrategy.no_shard:
        full = torch.zeros(group.layout.padded_numel, dtype=pieces[0].dtype if pieces else group.main_dtype,
                           device=group.device)
        for span, piece in zip(group.layout.spans, pieces):
            full[span.flat_start:span.flat_end].copy_(piece.reshape(-1))
        return full
    return _unsharded_of_shard(model, group, _shard_of_pieces(model, group, pieces))


def _rows_of_full(group: ParamGroup, fulls: List[torch.Tensor]) -> List[torch.Tensor]:
    """Per parameter, this rank's rows (views) of its full value."""
    return [full[slice(*group.row_range(index))] if group.layout.shapes[index]
            else full.reshape(()) for index, full in enumerate(fulls)]


def _rows_of_pieces(model, group: ParamGroup, pieces: List[torch.Tensor]) -> List[torch.Tensor]:
    """Per parameter, this rank's rows from the optimizer-level pieces (views where the pieces are this rank's
    rows already: everywhere but under HFSDP)."""
    if model.strategy == ShardingStrategy.no_shard:
        return _rows_of_full(group, pieces)
    if _in_outer_sub_shards(group):
        shard = _shard_of_pieces(model, group, pieces)
        return [group.rows_of_shard(shard, index) for index in range(len(pieces))]
    rows = []
    for index, piece in enumerate(pieces):
        if group.layout.shapes[index]:
            rows.append(piece.view(group.layout.local_shape(index, group.dp_rank)))
        else:  # rank 0 holds a 0-dim parameter; the others contribute zeros to the sum
            rows.append(piece.reshape(()) if piece.numel() else torch.zeros((), dtype=piece.dtype,
                                                                               device=piece.device))
    return rows


def _scalar_indices(group: ParamGroup) -> List[int]:
    return [index for index, shape in enumerate(group.layout.shapes) if not shape]


def _replicate_scalars(model, group: ParamGroup, rows: List[torch.Tensor],
                       known: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """0-dim values held by data-parallel rank 0 only -> the value on every rank: `known` (the values, in
    `_scalar_indices` order, where every rank has them without communication), else one sum over the group.
    Rank 0 keeps its row as it is (a view where `rows` are views, so a write into the state dict reaches it)."""
    if model.strategy == ShardingStrategy.no_shard:
        return rows
    scalars = _scalar_indices(group)
    if not scalars:
        return rows
    values = known
    if values is None:
        values = torch.stack([rows[index].detach().to(torch.float64) for index in scalars])
        if group.dp_rank != 0:
            values.zero_()
        collectives.all_reduce_scalar_sum(values, group.topology.dp_group)
    rows = list(rows)
    for position, index in enumerate(scalars):
        if group.dp_rank != 0:  # rank 0's own value stays: a view, so a write into the state dict reaches it
            rows[index] = values[position] if values.dtype == rows[index].dtype else values[position].to(
                rows[index].dtype)
    return rows


# Strategy 3 keeps a 0-dim parameter in rank 0's shard only; `model.state_dict()` must not communicate (FSDP2's
# does not, and `if rank == 0: torch.save(model.state_dict(), ...)` is a common habit), so every rank keeps a
# replica of its group's 0-dim compute weights, refreshed where all ranks act together: wrapping, each optimizer
# step's install, `load_state_dict` (from the loaded values, without communication). The optimizer keeps replicas
# of its 0-dim state the same way (see `refresh_optimizer_scalar_replicas`). They are current while no
# write reached the compute shard, the replicas (which the state dict hands out on ranks other than 0, so that
# `dcp.load` into it writes them) or the 0-dim resting parameters (in-place DTensor ops between steps) since;
# otherwise the next state dict sums the values over the group once more (a collective: call it on every rank).
def _scalar_replica_versions(model, group: ParamGroup) -> tuple:
    resting = model.schedule.resting.placeholders() if model.schedule.resting is not None else {}
    return (group.compute_shard._version, group.scalar_replicas._version,
            tuple(resting[id(group.params[index])]._version for index in _scalar_indices(group)
                  if id(group.params[index]) in resting))


def _keeps_scalar_replicas(group: ParamGroup) -> bool:
    """Strategy 3, HFSDP included (its compute shards are rebuilt from the outer ranks' main weights after each
    step and load, before the replicas are taken)."""
    return group.shards_params and bool(_scalar_indices(group))


def _set_scalar_replicas(model, group: ParamGroup, values: torch.Tensor):
    group.scalar_replicas = values.to(device=group.compute_shard.device, dtype=group.compute_shard.dtype)
    group.scalar_replicas_versions = _scalar_replica_versions(model, group)


def refresh_scalar_replicas(model, groups=None):
    """Collective: every rank's replicas of the 0-dim compute weights of `groups` (default: all) of strategy 3."""
    for group in model.groups if groups is None else groups:
        if _keeps_scalar_replicas(group):
            rows = _replicate_scalars(model, group, _weight_rows(model, group))
            _set_scalar_replicas(model, group, torch.stack([rows[index].detach()
                                                            for index in _scalar_indices(group)]))


def _current_scalar_replicas(model, group: ParamGroup) -> Optional[torch.Tensor]:
    if group.scalar_replicas is None or _scalar_replica_versions(model, group) != group.scalar_replicas_versions:
        return None
    return group.scalar_replicas


def _row_dtensors(model, group: ParamGroup, rows: List[torch.Tensor], copy: bool = False,
                  known_scalars: Optional[torch.Tensor] = None, full_weights: bool = False) -> List[DTensor]:
    """One DTensor of the full (TP-unpartitioned) shape per parameter, holding this rank's `rows` of its
    (partition of the) parameter (views of them, or copies with `copy`). `known_scalars`: see `_replicate_scalars`;
    `full_weights`: `rows` are of the full weights every rank holds (`_weight_rows` of strategies 0-2), 0-dim
    values included."""
    mesh, dp_mesh_dim, tp_mesh_dim = group.topology.checkpoint_mesh()
    if not full_weights:
        rows = _replicate_scalars(model, group, rows, known_scalars)
    result = []
    for index, (span, param) in enumerate(zip(group.layout.spans, group.params)):
        local = rows[index].detach()
        if copy:
            local = local.clone()
        partition_dim = _tp_partition_dim(group, param)
        shape = tensor_parallel_full_shape(span.shape, partition_dim, group.topology.tp_size)
        result.append(make_row_sharded_dtensor(local, shape, mesh, dp_mesh_dim, tp_mesh_dim, partition_dim))
    return result


def _weight_rows(model, group: ParamGroup) -> List[torch.Tensor]:
    """This rank's rows of every parameter in the compute dtype, as views of the weights the module computes
    with (the compute shard, or the full compute buffer of strategies 0-2 through `state_dict_alias`)."""
    if group.shards_params:
        return [group.rows_of_shard(group.compute_shard, index) for index in range(len(group.params))]
    if group.state_dict_alias is None:
        group.state_dict_alias = group.compute_buffer.data  # see GroupWeights.state_dict_alias
        group.state_dict_alias_version = group.state_dict_alias._version
    alias = group.state_dict_alias
    return _rows_of_full(group, [alias[span.flat_start:span.flat_end].view(span.shape) for span in group.layout.spans])


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
                keys.append((state_dict_name(prefix + name), "param", canonical[id(param)]))
        for name, buffer in submodule._buffers.items():
            if buffer is not None and name not in submodule._non_persistent_buffers_set:
                keys.append((state_dict_name(prefix + name), "buffer", canonical[id(buffer)]))
    return keys


def model_state_dict(model) -> Dict[str, object]:
    """Keys equal `model.module.state_dict()`'s; a tied parameter's aliases map to the same DTensor. Like
    `nn.Module.state_dict()`, the DTensors' local tensors are views of the weights (this rank's rows of them),
    not copies. (The optimizer's state dict holds copies: loading the model state writes the main weights,
    which the optimizer state loaded next must not have aliased.)"""
    _check_checkpointable(model)
    model.schedule.wait_gathered(model.groups)  # strategies 1/2: the post-step all-gather may be in flight
    model.schedule.refresh_compute_shards(model.groups, async_op=False)  # HFSDP: compute shards up to date
    params = {}
    for group in model.groups:
        known_scalars = None
        if _keeps_scalar_replicas(group):
            if _current_scalar_replicas(model, group) is None:
                refresh_scalar_replicas(model, [group])  # written since they were taken: one sum over the group
            known_scalars = group.scalar_replicas
        tensors = _row_dtensors(model, group, _weight_rows(model, group), known_scalars=known_scalars,
                                full_weights=not group.shards_params)
        for name, tensor in zip(group.names, tensors):
            params[name] = tensor
    buffers = {name: buffer.detach().clone() for name, buffer in model.module.named_buffers()}
    state = {}
    for key, kind, canonical in module_state_keys(model.module):
        state[key] = params[canonical] if kind == "param" else buffers[canonical]
    return state


def gather_rows_written_through_state_dict(model):
    """Strategies 0-2: a write into the DTensors of `model.state_dict()` (`dcp.load(sd)` without
    `model.load_state_dict(sd)`, which torch FSDP2 allows) sets this rank's rows of the full compute weights only,
    so the ranks would compute with mixed weights. Called before each forward (and `generate`,
    `gathered_parameters`, `apply`, `broadcast_params`, which read the full weights): such a write raises, naming
    what to call. No communication, so `state_dict()` may be called on some ranks only (strategy 3, whose state
    dict views the shards themselves, loads in place)."""
    for group in model.groups:
        if group.state_dict_alias is not None and _written_through_state_dict(group):
            raise RuntimeError(
                f"the weights of {group.names[:3]}{'...' if len(group.names) > 3 else ''} were written through "
                f"model.state_dict() (zero_dp_strategy '{model.strategy.name}': each rank holds the full weights and "
                "a write into the state dict sets only its own rows, so the ranks would compute with mixed "
                "weights). Call `model.load_state_dict(sd)` after `dcp.load(sd, ...)`")


def _written_through_state_dict(group: ParamGroup) -> bool:
    return group.state_dict_alias._version != group.state_dict_alias_version


def _note_state_dict_rows_gathered(group: ParamGroup):
    if group.state_dict_alias is not None:
        group.state_dict_alias_version = group.state_dict_alias._version


def _shard_from_rows(model, group: ParamGroup, values: List[torch.Tensor], dtype) -> torch.Tensor:
    """This rank's rows of every parameter (from checkpoint values) -> this rank's whole shard, padding zeroed.
    No communication, except under no_shard, whose "shard" is the full group: every rank writes its rows into
    zeros and the sum over the data-parallel group assembles it."""
    topology = group.topology
    if model.strategy == ShardingStrategy.no_shard:
        full = torch.zeros(group.layout.padded_numel, dtype=dtype, device=group.device)
        for index, (span, value) in enumerate(zip(group.layout.spans, values)):
            rows = local_rows_of(value, span.shape, topology.dp_size, topology.dp_rank)
            start, end = group.row_range(index)
            if not span.shape:
                start, end = (0, 1) if group.dp_rank == 0 else (0, 0)
            row_numel = group.layout.chunks[index].row_numel
            full[span.flat_start + start * row_numel:span.flat_start + end * row_numel].copy_(
                rows.reshape(-1)[:(end - start) * row_numel])
        collectives.all_reduce_scalar_sum(full, topology.dp_group)
        return full
    shard = torch.zeros(group.layout.shard_numel, dtype=dtype, device=group.device)
    for span, value, piece in zip(group.layout.spans, values, group.pieces):
        if piece.numel:
            rows = local_rows_of(value, span.shape, topology.dp_size, topology.dp_rank)
            shard[piece.shard_start:piece.shard_end].copy_(rows.reshape(-1))
    return shard


def _main_level(model, group: ParamGroup, shard: torch.Tensor) -> torch.Tensor:
    """A whole shard -> what the main weights (and the optimizer's state) hold: the HFSDP sub-shard, or the
    shard itself (for no_shard the full group)."""
    if _in_outer_sub_shards(group):
        return shard[group.sub_shard_slice]
    return shard


def _current_rows(model, group: ParamGroup) -> List[torch.Tensor]:
    """This rank's rows of every parameter of `group` as loading would write them: the main weights (in their
    own dtype, so a partial load leaves the other parameters' fp32 values as they are), else the compute weights."""
    if group.main_weights is None:
        return _weight_rows(model, group)
    if group.compute_written():  # writes to the parameters since the last step (see adopt_written_weights)
        group.adopt_written_compute_weights()
    return _rows_of_pieces(model, group, [view.to(group.device) for view in group.main_param_views])


def load_model_state_dict(model, state_dict, strict: bool = True):
    _check_checkpointable(model)
    model.schedule.wait_gathered(model.groups)
    # A tied parameter may come under any of its names (a plain module's state dict holds them all), and any
    # entry under its `named_parameters()` name too (a checkpoint-wrapped module's, with the wrapper's prefix).
    aliases = {}
    for key, _, canonical in module_state_keys(model.module):
        aliases.setdefault(canonical, [canonical]).append(key)
    missing = sorted(key for keys in aliases.values() for key in keys[1:] if not any(k in state_dict for k in keys))
    unexpected = sorted(set(state_dict) - {key for keys in aliases.values() for key in keys})
    if strict and (missing or unexpected):
        raise RuntimeError(f"MegatronFSDP.load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    values = {}
    for canonical, keys in aliases.items():
        present = [key for key in keys if key in state_dict]
        if present:
            values[canonical] = state_dict[present[0]]
    state_dict = values
    buffers = dict(model.module.named_buffers())
    loaded_scalars = {}  # id(group) -> its 0-dim values as loaded, in `_scalar_indices` order
    optimizer_replicas = {(id(optimizer), id(group)): _current_optimizer_scalar_replicas(optimizer, group)
                          for optimizer in model.grad_clearing.optimizers() for group in model.groups}
    with torch.no_grad():
        for group in model.groups:
            present = [name in state_dict for name in group.names]
            if not any(present):
                continue
            dtype = group.main_dtype if group.main_weights is not None else group.param_dtype
            values = [state_dict.get(name) for name in group.names]
            if not all(present):  # strict=False: the parameters the dict lacks keep their current values
                current = _row_dtensors(model, group, _current_rows(model, group), copy=True)
                values = [value if loaded else current[index]
                          for index, (value, loaded) in enumerate(zip(values, present))]
            values = _tensor_parallel_local_values(model, group, values)
            shard = _shard_from_rows(model, group, values, dtype)
            if group.main_weights is not None:
                group.write_main_weights(_main_level(model, group, shard))
                group.install_main_into_compute()
            elif group.shards_params:
                group.compute_shard.copy_(shard)
            elif model.strategy == ShardingStrategy.no_shard:
                group.compute_buffer.copy_(shard)  # the full group already
            else:  # frozen groups of strategies 1/2 are never re-gathered: they take the whole group at once
                group.compute_buffer.copy_(_unsharded_of_shard(model, group, shard))
            # The parameters view the buffers without sharing their version counters: bump theirs, as an in-place
            # write to them would, so that whatever keys on a parameter's version (a layer's FP8 weight cached for
            # the step) sees the new values.
            torch.autograd.graph.increment_version(group.params)
            if _scalar_indices(group) and model.strategy != ShardingStrategy.no_shard:
                # every rank was given the 0-dim values: no sum needed
                topology = group.topology
                loaded_scalars[id(group)] = torch.stack([
                    local_rows_of(values[index], (), topology.dp_size, topology.dp_rank).to(dtype)
                    for index in _scalar_indices(group)])
        for name, buffer in buffers.items():
            if name in state_dict:
                value = state_dict[name]
                buffer.copy_(value.full_tensor() if isinstance(value, DTensor) else value)
    for group in model.groups:  # the full compute weights hold what was loaded on every rank
        _note_state_dict_rows_gathered(group)
    if model.strategy in (ShardingStrategy.optim, ShardingStrategy.optim_grads):
        model.schedule.start_param_sync(async_op=False)
    elif model.strategy == ShardingStrategy.optim_grads_params:
        model.schedule.refresh_compute_shards(model.groups, async_op=False)  # HFSDP: from the loaded main weights
        for group in model.groups:
            if group.gathered:
                group.gathered = False
                model.schedule.ensure_gathered([group])
    for group in model.groups:
        if id(group) not in loaded_scalars:
            continue
        if _keeps_scalar_replicas(group):
            _set_scalar_replicas(model, group, loaded_scalars[id(group)])
        for optimizer in model.grad_clearing.optimizers():  # the main weights took the loaded values
            replicas = optimizer_replicas.get((id(optimizer), id(group)))
            if replicas is not None and _keeps_optimizer_scalar_replicas(group):
                if MAIN_PARAM_KEY in replicas:
                    replicas = {**replicas, MAIN_PARAM_KEY: loaded_scalars[id(group)].to(group.main_dtype)}
                _set_optimizer_scalar_replicas(optimizer, group, replicas)
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


def _is_element_state(value, current, view) -> bool:
    """Whether a saved optimizer-state value holds one entry per element of its parameter (Adam's moments, SGD's
    momentum) rather than one per parameter (a step count). A 0-dim parameter's moments are 0-dim like its step
    count; they are saved as DTensors (the step count as a plain tensor), and a plain 0-dim value (a no_shard
    save, or a full-tensor state dict) counts as one when the optimizer's own state for the key is shaped like
    the parameter's main-weight view (Adam's state exists from the start)."""
    if not isinstance(value, torch.Tensor):
        return False
    return isinstance(value, DTensor) or value.dim() > 0 or _is_sharded_state(current, view)


# Adam moments an optimizer may store scaled (`get_unscaled_state` / `set_scaled_state`: TE's FusedAdam, the
# precision-aware AdamW with fp16 moments); state dicts hold their values.
SCALED_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _is_scale_of_saved_value(optimizer, key) -> bool:
    """The precision-aware AdamW's scale of an fp16 moment (`<moment>_scale`): the state dict holds the moment's
    value, and loading it picks the scale again."""
    return hasattr(optimizer, "get_unscaled_state") and key in {f"{name}_scale" for name in SCALED_STATE_KEYS}


def _state_value(optimizer, view, key):
    if key in SCALED_STATE_KEYS and hasattr(optimizer, "get_unscaled_state"):
        return optimizer.get_unscaled_state(view, key)
    return optimizer.state[view][key]


def _optimizer_state_keys(optimizer, group: ParamGroup) -> List[str]:
    """The keys `optimizer.state_dict()` saves as DTensors for `group`: its element-wise state, then the main
    weights where they are kept in another dtype than the compute weights."""
    keys = set()
    for view in group.main_param_views:
        keys.update(k for k, v in optimizer.state.get(view, {}).items() if _is_sharded_state(v, view))
    return sorted(keys) + ([MAIN_PARAM_KEY] if group.main_dtype != group.param_dtype else [])


def _optimizer_state_rows(optimizer, model, group: ParamGroup, key: str) -> List[torch.Tensor]:
    """Per parameter of `group`, this rank's rows of state `key` (0-dim values on data-parallel rank 0 only)."""
    views = group.main_param_views
    # `.to(group.device)`: an offloading optimizer (--optimizer-cpu-offload) keeps this state, and maybe the main
    # weights themselves, in host memory; the DTensors live on the model's device.
    if key == MAIN_PARAM_KEY:
        pieces = [view.to(group.device) for view in views]
    else:
        pieces = [_state_value(optimizer, view, key).to(group.device) if key in optimizer.state.get(view, {})
                  else torch.zeros_like(view, device=group.device) for view in views]
    return _rows_of_pieces(model, group, pieces)


# Under strategies 1-3 a 0-dim parameter's main weight and optimizer state (its Adam moments) live on data-parallel
# rank 0 only, and every rank's `optimizer.state_dict()` holds their values. It must not communicate (FSDP2's does
# not, and `if rank == 0: torch.save({"model": ..., "optim": optimizer.state_dict()}, f)` is a common habit), so
# every rank keeps replicas of them, refreshed where all ranks act together: `fully_shard_optimizer`,
# `add_param_group`, after each step (the only time the optimizer writes its state) and on loading. They are
# current while this rank's state tensors of those parameters (and main weights, where saved) were not written
# otherwise since; else the next state dict sums the values over the group once more (a collective: call it on
# every rank). HFSDP groups keep none: their state dict all-gathers the sub-shards over the outer group anyway.
def _keeps_optimizer_scalar_replicas(group: ParamGroup) -> bool:
    return (group.main_weights is not None and group.strategy != ShardingStrategy.no_shard
            and not _in_outer_sub_shards(group) and bool(_scalar_indices(group)))


def _optimizer_scalar_versions(optimizer, group: ParamGroup) -> tuple:
    versions = []
    for index in _scalar_indices(group):
        view = group.main_param_views[index]
        if group.main_dtype != group.param_dtype:
            versions.append((id(view), view._version))
        versions.extend((key, id(value), value._version) for key, value in
                        sorted(optimizer.state.get(view, {}).items()) if isinstance(value, torch.Tensor))
    return tuple(versions)


def _set_optimizer_scalar_replicas(optimizer, group: ParamGroup, replicas: Dict[str, torch.Tensor]):
    """`replicas`: state key -> the values of `group`'s 0-dim parameters, in `_scalar_indices` order."""
    store = optimizer.__dict__.setdefault("_megatron_fsdp_scalar_replicas", {})
    store[id(group)] = (replicas, _optimizer_scalar_versions(optimizer, group))


def _current_optimizer_scalar_replicas(optimizer, group: ParamGroup) -> Optional[Dict[str, torch.Tensor]]:
    if not _keeps_optimizer_scalar_replicas(group):
        return None
    entry = getattr(optimizer, "_megatron_fsdp_scalar_replicas", {}).get(id(group))
    if entry is None or entry[1] != _optimizer_scalar_versions(optimizer, group):
        return None
    return entry[0]


def refresh_optimizer_scalar_replicas(optimizer):
    """Collective: every rank's replicas of the 0-dim state (and main weights) `optimizer.state_dict()` saves."""
    model = optimizer._megatron_fsdp_model
    for group in model.groups:
        if not _keeps_optimizer_scalar_replicas(group):
            continue
        scalars, keys = _scalar_indices(group), _optimizer_state_keys(optimizer, group)
        values = torch.zeros(len(keys) * len(scalars), dtype=torch.float64, device=group.device)
        if group.dp_rank == 0:
            for position, key in enumerate(keys):
                rows = _optimizer_state_rows(optimizer, model, group, key)
                values[position * len(scalars):(position + 1) * len(scalars)].copy_(
                    torch.stack([rows[index].detach().to(torch.float64) for index in scalars]))
        collectives.all_reduce_scalar_sum(values, group.topology.dp_group)
        _set_optimizer_scalar_replicas(optimizer, group, {
            key: values[position * len(scalars):(position + 1) * len(scalars)] for position, key in enumerate(keys)})


def optimizer_state_dict(optimizer) -> dict:
    """{"state": {param name: {key: DTensor or scalar}}, "param_groups": [{hyper-params, "params": [names]}]}.
    Issues no collective, except under HFSDP (see `refresh_optimizer_scalar_replicas`)."""

    model, by_name = _optimizer_params_by_name(optimizer)
    _check_checkpointable(model)
    model.adopt_written_weights()  # the main weights saved include writes to the parameters since the last step
    initialize_optimizer_state(optimizer, sgd_momentum=True)
    names = optimizer._megatron_fsdp_param_names
    state = {}
    for group in model.groups:
        if group.main_weights is None:
            continue
        views = group.main_param_views
        replicas = _current_optimizer_scalar_replicas(optimizer, group) or {}
        for key in _optimizer_state_keys(optimizer, group):
            rows = _optimizer_state_rows(optimizer, model, group, key)
            for index, tensor in enumerate(_row_dtensors(model, group, rows, copy=True,
                                                         known_scalars=replicas.get(key))):
                if key == MAIN_PARAM_KEY or views[index] in optimizer.state:
                    state.setdefault(state_dict_name(group.names[index]), {})[key] = tensor
        for index, view in enumerate(views):
            for key, value in optimizer.state.get(view, {}).items():
                if not _is_sharded_state(value, view) and not _is_scale_of_saved_value(optimizer, key):
                    state.setdefault(state_dict_name(group.names[index]), {})[key] = value.clone() if isinstance(
                        value, torch.Tensor) else value
    param_groups = []
    for param_group in optimizer.param_groups:
        entry = {k: v for k, v in param_group.items() if k != "params"}
        entry["params"] = [state_dict_name(names[id(p)]) for p in param_group["params"]]
        param_groups.append(entry)
    _watch_optimizer_state_copies(optimizer, state)
    return {"state": state, "param_groups": param_groups}


def _watch_optimizer_state_copies(optimizer, state):
    """Remember the tensors of a handed-out optimizer state dict (copies, unlike torch's own state dict): a
    `dcp.load` into them without `optimizer.load_state_dict` would be lost, so the next step refuses it."""
    watched = [entry for entry in getattr(optimizer, "_megatron_fsdp_state_copies", []) if entry[0]() is not None]
    for entries in state.values():
        for value in entries.values():
            if isinstance(value, torch.Tensor):
                local = value._local_tensor if isinstance(value, DTensor) else value
                watched.append((weakref.ref(local), local._version))
    optimizer._megatron_fsdp_state_copies = watched


def _optimizer_state_copies_loaded(optimizer):
    """`optimizer.load_state_dict` took a state dict: what was written into the handed-out copies is loaded."""
    optimizer._megatron_fsdp_state_copies = [(ref, ref()._version) for ref, _ in
                                             getattr(optimizer, "_megatron_fsdp_state_copies", [])
                                             if ref() is not None]


def refuse_unloaded_optimizer_state_writes(optimizer):
    """Before a step: raise if a tensor of `optimizer.state_dict()` was written (`dcp.load` into it) and not
    loaded with `optimizer.load_state_dict` since; the step would run from the state it had before."""
    for ref, version in getattr(optimizer, "_megatron_fsdp_state_copies", []):
        tensor = ref()
        if tensor is not None and tensor._version != version:
            raise RuntimeError(
                "a tensor of optimizer.state_dict() was written (dcp.load into it?) but not loaded: the "
                "Megatron-FSDP optimizer's state dict holds copies of its sharded state, not the state itself. "
                "Call `optimizer.load_state_dict(sd)` after `dcp.load(sd, ...)` (and after "
                "`model.load_state_dict`, if called)")


def load_optimizer_state_dict(optimizer, state_dict):
    """Accepts the name-keyed form (DTensor or full-tensor states) or torch's own index-keyed form of the
    sharded optimizer (as saved by `torch.optim.Optimizer.state_dict` at the same data-parallel size).

    Main weights saved under MAIN_PARAM_KEY replace those the model state dict set (in the compute dtype), so
    load the model state first and the optimizer state second."""
    groups_in = state_dict["param_groups"]
    if groups_in and groups_in[0]["params"] and not isinstance(groups_in[0]["params"][0], str):
        optimizer._megatron_fsdp_original_load_state_dict(state_dict)
        refresh_optimizer_scalar_replicas(optimizer)
        return

    model, by_name = _optimizer_params_by_name(optimizer)
    _check_checkpointable(model)
    initialize_optimizer_state(optimizer, sgd_momentum=True)
    if len(groups_in) != len(optimizer.param_groups):
        raise ValueError(f"optimizer state dict has {len(groups_in)} param groups, the optimizer has "
                         f"{len(optimizer.param_groups)}")
    kept = getattr(optimizer, "settings_from_flags", ())  # keys the optimizer takes from this run, not a checkpoint
    for saved, current in zip(groups_in, optimizer.param_groups):
        current.update({k: v for k, v in saved.items() if k != "params" and k not in kept})
    saved_state = dict(state_dict["state"])
    for group in model.groups:  # keyed by state-dict name (or, as saved before, by `named_parameters()` name)
        for name in group.names:
            if name not in saved_state and state_dict_name(name) in saved_state:
                saved_state[name] = saved_state[state_dict_name(name)]
    main_weights_loaded = False
    # id(group) -> 0-dim replicas as loaded (every rank is given the values) over those current before
    scalar_replicas = {id(group): dict(_current_optimizer_scalar_replicas(optimizer, group) or {})
                       for group in model.groups}

    def note_loaded_scalars(group, key, values):
        if not _keeps_optimizer_scalar_replicas(group):
            return
        topology = group.topology
        scalar_replicas[id(group)][key] = torch.stack([
            local_rows_of(values[index], (), topology.dp_size, topology.dp_rank).to(torch.float64)
            for index in _scalar_indices(group)])

    with torch.no_grad():
        for group in model.groups:
            if group.main_weights is None or not any(name in saved_state for name in group.names):
                continue
            if all(MAIN_PARAM_KEY in saved_state.get(name, {}) for name in group.names):
                values = _tensor_parallel_local_values(model, group,
                                                       [saved_state[name][MAIN_PARAM_KEY] for name in group.names])
                if group.main_dtype != group.param_dtype:
                    note_loaded_scalars(group, MAIN_PARAM_KEY, values)
                group.write_main_weights(_main_level(model, group, _shard_from_rows(model, group, values,
                                                                                     group.main_dtype)))
                main_weights_loaded = True
            keys = set()
            for name, view in zip(group.names, group.main_param_views):
                keys.update(k for k, v in saved_state.get(name, {}).items() if k != MAIN_PARAM_KEY and
                            _is_element_state(v, optimizer.state.get(view, {}).get(k), view))
            for key in sorted(keys):
                values = _tensor_parallel_local_values(
                    model, group, [saved_state.get(name, {}).get(key) for name in group.names])
                note_loaded_scalars(group, key, values)
                flat = _main_level(model, group, _shard_from_rows(model, group, values, group.main_dtype))
                for index, view in enumerate(group.main_param_views):
                    target = group._main_view(flat, index)
                    if key in SCALED_STATE_KEYS and hasattr(optimizer, "set_scaled_state"):
                        # Stored by the optimizer in its dtype (fp16 moments with a scale: TE's, precision-aware).
                        optimizer.set_scaled_state(view, key, target.to(dtype=torch.float32, copy=True))
                        continue
                    existing = optimizer.state[view].get(key)
                    # State kept in another dtype (the precision-aware optimizer's bf16 moments) stays in it.
                    dtype = existing.dtype if isinstance(existing, torch.Tensor) else target.dtype
                    optimizer.state[view][key] = target.to(dtype=dtype, copy=True)
            for index, name in enumerate(group.names):
                for key, value in saved_state.get(name, {}).items():
                    if key not in keys and key != MAIN_PARAM_KEY:
                        view = group.main_param_views[index]
                        if isinstance(value, DTensor):
                            value = value.full_tensor()
                        optimizer.state[view][key] = value.clone() if isinstance(value, torch.Tensor) else value
    if main_weights_loaded:
        model.install_optimized_model_weights()
        model.schedule.wait_gathered(model.groups)
    for group in model.groups:
        replicas = scalar_replicas[id(group)]
        if _keeps_optimizer_scalar_replicas(group) and set(replicas) >= set(_optimizer_state_keys(optimizer, group)):
            _set_optimizer_scalar_replicas(optimizer, group, replicas)
    _optimizer_state_copies_loaded(optimizer)

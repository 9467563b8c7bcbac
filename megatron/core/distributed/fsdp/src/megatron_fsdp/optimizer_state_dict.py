"""`optimizer.state_dict()` / `optimizer.load_state_dict()` of an optimizer over a MegatronFSDP model (see
state_dict.py): name-keyed, with row-sharded DTensors for element-wise state, and the replicas of 0-dim state
that let the state dict issue no collective."""

import weakref
from typing import Dict, List, Optional

import torch
from torch.distributed.tensor import DTensor

from . import collectives
from .distributed_data_parallel_config import ShardingStrategy
from .optimizer_state import initialize_optimizer_state
from .param_and_grad_buffer import ParamGroup
from .state_dict_rows import (
    _check_checkpointable,
    _in_outer_sub_shards,
    _main_level,
    _row_dtensors,
    _rows_of_pieces,
    _scalar_indices,
    _shard_from_rows,
    _tensor_parallel_local_values,
    state_dict_name,
)
from .uneven_dtensor import local_rows_of
from .weight_buffers import _as_bits

# Optimizer-state key of the main weights, saved when they are kept in another dtype than the compute weights
# (the model state dict holds the compute dtype, so the main weights would otherwise come back rounded).
MAIN_PARAM_KEY = "main_param"


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


def _scalar_compute_values(group: ParamGroup) -> torch.Tensor:
    """This rank's compute weights of `group`'s 0-dim parameters, in `_scalar_indices` order: every rank holds them
    (the full weights of strategies 1/2, strategy 3's mirrored slots)."""
    if group.shards_params:
        return torch.stack([group.rows_of_shard(group.compute_shard, index).detach()
                            for index in _scalar_indices(group)])
    return torch.stack([group.compute_buffer[group.layout.spans[index].flat_start].detach()
                        for index in _scalar_indices(group)])


def _adopt_written_weights(model):
    """`model.adopt_written_weights()`, with every optimizer's replicas of the 0-dim main weights following what it
    adopts, without communicating. Rank 0 alone holds those main weights, so a write to a 0-dim parameter since the
    last step (made alike on every rank) moves its main weight's version counter only there: its replicas would go
    stale and its next state dict would sum over the group while the others' would not. Every rank holds the
    written value and the replica of the main weight, so each makes the comparison rank 0 makes."""
    followed = []
    for optimizer in model.grad_clearing.optimizers():
        for group in model.groups:
            replicas = _current_optimizer_scalar_replicas(optimizer, group)
            if replicas is not None and MAIN_PARAM_KEY in replicas:
                followed.append((optimizer, group, replicas))
    model.adopt_written_weights()
    for optimizer, group, replicas in followed:
        compute = _scalar_compute_values(group)
        main = replicas[MAIN_PARAM_KEY]
        as_main = main.to(group.main_dtype)
        written = _as_bits(compute).ne(_as_bits(as_main.to(compute.dtype)))
        adopted = torch.where(written.to(main.device), compute.to(group.main_dtype).to(main.device), as_main)
        _set_optimizer_scalar_replicas(optimizer, group, {**replicas, MAIN_PARAM_KEY: adopted.to(main.dtype)})


def optimizer_state_dict(optimizer) -> dict:
    """{"state": {param name: {key: DTensor or scalar}}, "param_groups": [{hyper-params, "params": [names]}]}.
    Issues no collective, except under HFSDP (see `refresh_optimizer_scalar_replicas`)."""

    model, by_name = _optimizer_params_by_name(optimizer)
    _check_checkpointable(model)
    _adopt_written_weights(model)  # the main weights saved include writes to the parameters since the last step
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

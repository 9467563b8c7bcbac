"""`model.state_dict()` / `model.load_state_dict()` of a MegatronFSDP model (see state_dict.py), and the
replicas of 0-dim compute weights that let the state dict issue no collective."""

from typing import Dict, List, Optional

import torch
from torch.distributed.tensor import DTensor

from .distributed_data_parallel_config import ShardingStrategy
from .optimizer_state_dict import (
    MAIN_PARAM_KEY,
    _current_optimizer_scalar_replicas,
    _keeps_optimizer_scalar_replicas,
    _set_optimizer_scalar_replicas,
)
from .param_and_grad_buffer import ParamGroup
from .state_dict_rows import (
    _check_checkpointable,
    _main_level,
    _replicate_scalars,
    _row_dtensors,
    _rows_of_pieces,
    _scalar_indices,
    _shard_from_rows,
    _tensor_parallel_local_values,
    _unsharded_of_shard,
    _weight_rows,
    state_dict_name,
)
from .uneven_dtensor import local_rows_of

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


"""Strategy 3's 0-dim parameters: rank 0's value mirrored into every rank's slot, so they rest as `Replicate()`.

A 0-dim parameter is one row of one element that shard rank 0 owns (layout.py); every other rank has a
one-element padding slot for it in its compute shard, which no gather, reduction or optimizer step reads. Those
slots hold a copy of rank 0's value, so the resting parameter (resting_parameters.py) is a `Replicate()` DTensor
over each rank's slot, and element-wise in-place ops on it (`p.clamp_(0, 1)`, `p.fill_`, `torch.nn.init.
constant_`) work as they do on any replicated DTensor: made alike on every rank, they change the value everywhere;
the forward, the optimizer step and the state dict take rank 0's.

The copies are refreshed wherever rank 0's value changes with every rank acting together:
- `mirror_from_rank0`: at wrapping, after each optimizer step's install and after `model.apply(fn)`: one
  broadcast of the group's 0-dim values over its shard ranks. The values broadcast are also the replicas that
  let `model.state_dict()` issue no collective (model_state_dict.py), so this replaces the sum that refreshed
  them: no collective is added.
- `mirror_known`: after `load_state_dict`, which gave every rank the loaded values (no communication).
- `mirror_gathered`: on exit from `gathered_parameters()`, where every rank holds the full weights and sees
  which values were written inside (none).
Where a separate main-weight buffer is laid out like the shard, its padding slot takes the value too: the
between-step write check (`compute_written`) would otherwise see the copy as a write every step.
"""

from typing import Dict, List

import torch

from . import collectives
from .model_state_dict import _current_scalar_replicas, _set_scalar_replicas
from .state_dict_rows import _scalar_indices
from .weight_buffers import _as_bits


def groups_with_scalars(groups) -> list:
    """The strategy-3 groups holding 0-dim parameters (the same list on every rank)."""
    return [group for group in groups if group.shards_params and _scalar_indices(group)]


def _write_copies(model, group, values: torch.Tensor):
    """Every rank but shard rank 0: `values` (the group's 0-dim values, in `_scalar_indices` order) into its slots.
    Then the state dict's replicas are `values`, current as of now."""
    if group.dp_rank != 0:
        main = group.main_weights
        main_laid_like_shard = (main is not None and main is not group.compute_shard and not group.main_separated
                                and main is not group.compute_buffer)
        for position, index in enumerate(_scalar_indices(group)):
            slot = group.pieces[index].shard_start
            group.compute_shard[slot].copy_(values[position])
            if main_laid_like_shard:
                offset = slot - (group.sub_shard_slice.start if group.outer_sharded else 0)
                if 0 <= offset < main.numel():
                    # through `.data`: padding is no parameter's, so the main-weight views' version counters
                    # (which keep the optimizer's 0-dim replicas current) must not move
                    main.data[offset].copy_(values[position])
    _set_scalar_replicas(model, group, values)


def mirror_from_rank0(model, groups=None):
    """Collective over each group's shard ranks: rank 0's 0-dim values of `groups` (default: all) into the other
    ranks' slots. Call it on every rank, with the same groups."""
    for group in groups_with_scalars(model.groups if groups is None else groups):
        values = torch.stack([group.rows_of_shard(group.compute_shard, index).detach()
                              for index in _scalar_indices(group)]).to(group.device)
        collectives.broadcast_small(values, group.topology.dp_group)
        _write_copies(model, group, values)


def mirror_known(model, groups=None):
    """After a load that gave every rank the 0-dim values (the state dict's replicas, current): into the slots."""
    for group in groups_with_scalars(model.groups if groups is None else groups):
        replicas = _current_scalar_replicas(model, group)
        if replicas is not None:
            _write_copies(model, group, replicas.clone())


def gathered_scalars(group) -> torch.Tensor:
    """The group's 0-dim values in its gathered compute buffer (the same on every rank), in `_scalar_indices`
    order: a copy."""
    return torch.stack([group.compute_buffer[group.layout.spans[index].flat_start]
                        for index in _scalar_indices(group)]).detach().clone()


def mirror_gathered(model, groups: List, at_gather: Dict[int, torch.Tensor]):
    """`groups` gathered, every rank holding their full compute weights: each 0-dim value written since they were
    gathered (`at_gather`: id(group) -> `gathered_scalars` then) into the slots. The others keep the value this
    rank holds: a gather codec may have decoded them inexactly."""
    for group in groups_with_scalars(groups):
        now = gathered_scalars(group)
        held = torch.stack([group.rows_of_shard(group.compute_shard, index).detach()
                            for index in _scalar_indices(group)]).to(now.device)
        written = _as_bits(now).ne(_as_bits(at_gather[id(group)].to(now.device)))
        _write_copies(model, group, torch.where(written, now, held))

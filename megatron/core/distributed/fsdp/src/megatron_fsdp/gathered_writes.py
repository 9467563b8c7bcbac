"""Writes made to the full weights inside `MegatronFSDP.gathered_parameters()` become the weights that train on.

Under strategy 3 the full weights shown inside the context live in transient compute buffers that are dropped on
exit; the weights that persist are each rank's compute shard and, where the optimizer keeps them apart, its main
weights. So on exit each rank compares its own rows in the gathered buffer with its shard, bit for bit, and where
they differ (a write: `p.data.mul_`, `p.copy_`, `torch.nn.init`, `layer.reset_parameters()`) copies them into the
shard; the main weights then take every element written (`adopt_written_compute_weights`, which keeps the main
precision of the others), as torch FSDP1's `summon_full_params(writeback=True)` does. Each rank writes back its
own rows only, with no communication: the writes must be the same on every rank, or the ranks' rows would come
from different models.

With a gather codec the gathered weights are decoded from an encoding, not copies of the shard: the rows are
compared with a snapshot taken on entry instead, and only the elements that changed since replace the shard's.
Strategies 0-2 compute with the full weights themselves; on exit their main weights adopt the writes as well, so
that the optimizer's state dict sees them before the next step.

The optimizer keeps replicas of its 0-dim state so that `optimizer.state_dict()` needs no collective, current
while the main weights' version counters stay put (optimizer_state_dict.py); a stale replica is summed over the
ranks again, so every rank must see it stale alike. A write may reach one rank's main weights only (rank 0's
0-dim value, or rows only rank 0 holds), so whether a group holding 0-dim parameters was written is agreed over
its shard ranks (one small all-reduce per process group) and every rank then moves those counters.
"""

from dataclasses import dataclass
from typing import Dict, List

import torch

from . import collectives
from .distributed_data_parallel_config import ShardingStrategy
from .scalar_slots import gathered_scalars, groups_with_scalars, mirror_gathered
from .state_dict_rows import _scalar_indices
from .weight_buffers import _as_bits


def _gathered_rows(group) -> List[torch.Tensor]:
    """This rank's rows of each parameter in the gathered compute buffer (flat views; empty where it has none)."""
    return [group.compute_buffer[span.flat_start + piece.param_start:span.flat_start + piece.param_end]
            for span, piece in zip(group.layout.spans, group.pieces)]


def _shard_rows(group) -> List[torch.Tensor]:
    return [group.compute_shard[piece.shard_start:piece.shard_end] for piece in group.pieces]


@dataclass
class GatherSnapshot:
    """Taken on entry: copies of this rank's gathered rows of the groups gathered through a codec, and of every
    strategy-3 group's gathered 0-dim values, by id(group)."""

    decoded_rows: Dict[int, List[torch.Tensor]]
    scalars: Dict[int, torch.Tensor]


def snapshot_on_entry(groups) -> GatherSnapshot:
    return GatherSnapshot(
        decoded_rows={id(group): [rows.clone() for rows in _gathered_rows(group)]
                      for group in groups if group.codec is not None and not group.resident},
        scalars={id(group): gathered_scalars(group) for group in groups_with_scalars(groups)})


def _changed(now: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    return _as_bits(now).ne(_as_bits(before.to(now.device)))


def write_back_gathered_rows(model, groups, snapshot: GatherSnapshot):
    """Strategy 3, `groups` gathered: this rank's written rows into its compute shard, then into the main weights.
    A resident group computes with its shard itself: only the main weights have to follow."""
    written = set()
    for group in groups:
        if group.resident:
            continue
        before = snapshot.decoded_rows.get(id(group))
        pairs = list(zip(_gathered_rows(group), _shard_rows(group), before or _shard_rows(group)))
        pairs = [pair for pair in pairs if pair[0].numel()]
        if not pairs:
            continue
        flags = torch.stack([_changed(now, reference).any() for now, _, reference in pairs])
        if not bool(flags.any()):
            continue
        written.add(id(group))
        for now, shard, reference in pairs:
            if before is None:
                shard.copy_(now)
            else:
                shard.copy_(torch.where(_changed(now, reference), now.to(shard.device), shard))
        group.wire_shard_stale = group.codec is not None
    mirror_gathered(model, groups, snapshot.scalars)
    for group in groups:  # the main weights take every element written (see weight_buffers.py)
        if group.compute_written():
            written.add(id(group))
            group.adopt_written_compute_weights()
    _agree_on_scalar_group_writes(groups, written)


def adopt_full_weight_writes(model):
    """Strategies 0-2: the main weights take what was written to this rank's rows of the full weights."""
    written = {id(group) for group in model.groups if group.compute_written()}
    model.adopt_written_weights()
    _agree_on_scalar_group_writes(model.groups, written)


def _agree_on_scalar_group_writes(groups, written):
    """See the module docstring: a group holding 0-dim parameters written on any of its shard ranks has the
    version counters of its 0-dim main weights moved on all of them."""
    by_process_group = {}
    for group in groups:  # those whose optimizer keeps 0-dim replicas (no_shard's has every value: none)
        if (_scalar_indices(group) and group.main_weights is not None and group.dp_size > 1
                and group.strategy != ShardingStrategy.no_shard):
            by_process_group.setdefault(id(group.topology.dp_group), (group.topology.dp_group, []))[1].append(group)
    for process_group, members in by_process_group.values():
        flags = torch.tensor([id(group) in written for group in members], dtype=torch.int32, device=members[0].device)
        collectives.all_reduce_max(flags, process_group)
        for group, flag in zip(members, flags.tolist()):
            if flag:
                torch.autograd.graph.increment_version([group.main_param_views[index]
                                                        for index in _scalar_indices(group)])

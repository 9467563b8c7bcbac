"""When the compute weights are gathered and released: the all-gather and release policy of the schedule.

`GatherReleasePolicy` is the part of `schedule.Schedule` that moves weights: gathering groups (strategy 3, with
a pooled unit claiming its slot first), waiting for and releasing them, HFSDP's refresh of the compute shards
from the outer ranks' main weights, and after the optimizer step the gathers of strategies 1/2 through a window
of `max_param_syncs_in_flight` groups in the order the next forward uses them. The hooks in schedule.py decide
when; `ParamGroup` (weight_buffers.py) does the copies; `collectives` issues the all-gathers.
"""

import functools
from typing import Dict, List, Optional

import torch

from . import collectives
from .coalesced_gathers import CoalescedGathers
from .distributed_data_parallel_config import ShardingStrategy
from .param_and_grad_buffer import ParamGroup
from .weight_buffers import WeightState

# Groups whose gathered weights are smaller than this many bytes are gathered together, as one exchange, when one
# call gathers several of them; a prefetch also takes the next units along while their weights together stay
# under it (see `GatherReleasePolicy.coalesce_gather_bytes`).
COALESCE_GATHER_BYTES = 2 * 1024 * 1024


class GatherReleasePolicy:
    """Gathers, releases and post-step weight installs of a `Schedule` (mixed into it; reads the state its
    constructor sets up: `groups`, `units`, `pool`, `streams`, `pending_shard_refreshes`, `param_syncs_*`, ...)."""

    # ids of the groups `MegatronFSDP.gathered_parameters()` holds gathered: `release` leaves them (a forward run
    # inside the context would otherwise drop the weights shown there, and writes made to them)
    held_gathered: frozenset = frozenset()

    # Where gathers are built from point-to-point messages (gloo), the gathers of groups under this many bytes
    # that one call starts go out as one exchange (coalesced_gathers.py: each piece lands where its own gather
    # puts it), a prefetch of a unit that is still sharded takes the next units along while their weights
    # together stay under it, and the units before the last one, from the end while their weights together stay
    # under it, stay gathered from their forward to their backward (schedule.py): a model of small units gathers
    # several of them per exchange, and not again for the backward (on gloo every exchange costs host time
    # whatever its size). The price is at most this many bytes of weights gathered ahead of their use and as many
    # held for the backward. 0 turns it off.
    coalesce_gather_bytes = COALESCE_GATHER_BYTES

    # ---- gathering ----------------------------------------------------------------------------------------------
    def _claim_pool_slot(self, group: ParamGroup):
        slot = group.unit_index % 2
        previous = self.pool.owner[slot]
        if previous is not None and previous != group.unit_index:
            for other in self.units[previous].groups:
                self._wait_gather(other)
                other.gathered = False
        self.pool.owner[slot] = group.unit_index

    @property
    def pending_gathers(self) -> Dict[int, collectives.PendingCollective]:
        """All-gathers in flight, by group id (each group owns its own; see ParamGroup.weight_state)."""
        return {id(group): group.pending_gather for group in self.groups if group.pending_gather is not None}

    def gather(self, groups: List[ParamGroup], async_op: bool):
        started = False
        batch = CoalescedGathers(self._issue_gather_in_place) if self.coalesce_gather_bytes else None
        for group in groups:
            if group.weight_state is not WeightState.SHARDED:
                continue
            started = True
            self.note_transient(group)
            self._refresh_compute_shard(group)
            self._wait_compute_shard_refresh(group)
            if group.uses_pool:
                self._claim_pool_slot(group)
            group.allocate_compute()
            group.encode_wire_shard(self._shard_group(group))  # a gather codec's encoding, if the shard changed
            self._start_gather(group, batch)
            if self.resting is not None:
                self.resting.show(group)
        if batch is not None:
            batch.issue()
        if not async_op:
            self.wait_gathered(groups)
        if started:  # only a started gather allocates
            self._track_transient()

    def _shard_group(self, group: ParamGroup):
        """The ranks `group` is sharded over: the data-parallel group, or the expert data-parallel one."""
        return group.topology.dp_group if group.topology is not None else self.dp_group

    def _outer_group(self, group: ParamGroup):
        """The replicas `group` is reduced (HSDP) or further sharded (HFSDP) over: the outer group of its
        topology (the dense one, or the expert data-parallel ranks across the replicas)."""
        return group.topology.outer_group if group.topology is not None else self.outer_group

    def _issue_gather(self, process_group, output: torch.Tensor, shard: torch.Tensor) -> collectives.PendingCollective:
        """One all-gather of every shard rank's `shard` into the rank-major `output`, on the all-gather stream
        (`ParamGroup.start_gather` picks both and copies the result out when it is waited for)."""
        return self.streams.issue(self.streams.all_gather, lambda: collectives.all_gather_flat(
            output, shard, process_group, self.counter, async_op=True))

    def _issue_gather_in_place(self, process_group, outputs_by_rank: list, own_pieces: list
                               ) -> collectives.PendingCollective:
        return self.streams.issue(self.streams.all_gather, lambda: collectives.all_gather_pieces_in_place(
            outputs_by_rank, own_pieces, process_group, self.counter, async_op=True))

    def _start_gather(self, group: ParamGroup, batch: Optional[CoalescedGathers] = None):
        """Start `group`'s all-gather; with `batch`, a small one joins the batch's exchange over its process
        group, posted when the batch holds `coalesce_gather_bytes` or when `gather` is done adding groups."""
        process_group = self._shard_group(group)
        if batch is not None and self._gathers_coalesced(group):
            num_bytes = self._gather_bytes(group)
            group.start_gather(functools.partial(self._hold_flat_gather, batch, process_group, num_bytes),
                               functools.partial(batch.add, process_group, num_bytes))
            if batch.held_bytes(process_group) >= self.coalesce_gather_bytes:
                batch.issue(process_group)
            return
        in_place = collectives.gathers_in_place(process_group, group.compute_buffer)
        group.start_gather(functools.partial(self._issue_gather, process_group),
                           functools.partial(self._issue_gather_in_place, process_group) if in_place else None)

    @staticmethod
    def _hold_flat_gather(batch: CoalescedGathers, process_group, num_bytes: int, output: torch.Tensor,
                          shard: torch.Tensor) -> collectives.PendingCollective:
        """A gather into one rank-major buffer (a group whose shard is one slice of its compute buffer), held in
        `batch` as a gather of one piece per rank."""
        numel = shard.numel()
        by_rank = [[output[rank * numel:(rank + 1) * numel]] for rank in range(collectives.group_size(process_group))]
        return batch.add(process_group, num_bytes, by_rank, [shard])

    @staticmethod
    def _gather_bytes(group: ParamGroup) -> int:
        return group.layout.padded_numel * group.param_dtype.itemsize

    def _gathers_coalesced(self, group: ParamGroup) -> bool:
        """Whether `group`'s gather can join an exchange with others (see `coalesce_gather_bytes`): a gather from
        point-to-point messages, with no codec and no pool slot, of fewer bytes than the threshold."""
        return (not group.uses_pool and group.codec is None and self._gather_bytes(group) < self.coalesce_gather_bytes
                and collectives.gathers_in_place(self._shard_group(group), group.compute_buffer))

    def _wait_gather(self, group: ParamGroup):
        self._wait_compute_shard_refresh(group)
        while group in self.param_syncs_queued:  # its post-step gather has not started: let the window reach it
            self._finish_param_sync(self.param_syncs_in_flight[0])
        if group in self.param_syncs_in_flight:
            self._finish_param_sync(group)
        if group.pending_gather is not None:
            self.note_transient(group)  # landing a gather may allocate (a codec's decoded weights)
        group.finish_gather()

    def _finish_param_sync(self, group: ParamGroup):
        self.param_syncs_in_flight.remove(group)
        self.note_transient(group)
        group.finish_gather()
        self._start_queued_param_syncs()

    def _start_queued_param_syncs(self):
        while self.param_syncs_queued and len(self.param_syncs_in_flight) < self.max_param_syncs_in_flight:
            group = self.param_syncs_queued.pop(0)
            self.note_transient(group)
            self._start_gather(group)
            self.param_syncs_in_flight.append(group)
        self._track_transient()

    def _refresh_compute_shard(self, group: ParamGroup):
        """HFSDP: start the all-gather of every outer rank's main-weight sub-shard into this rank's compute
        shard, if the main weights changed since the last one."""
        if not group.compute_shard_stale:
            return
        source = group.outer_gather_source()
        pending = self.streams.issue(self.streams.all_gather, lambda: collectives.all_gather_flat(
            group.compute_shard, source, self._outer_group(group), self.counter, async_op=True))
        self.pending_shard_refreshes[id(group)] = (pending, source)
        group.compute_shard_stale = False

    def _wait_compute_shard_refresh(self, group: ParamGroup):
        refresh = self.pending_shard_refreshes.pop(id(group), None)
        if refresh is not None:
            refresh[0].wait()

    def refresh_compute_shards(self, groups: List[ParamGroup], async_op: bool):
        """HFSDP: bring the compute shards of `groups` up to date with the main weights (no-op otherwise)."""
        for group in groups:
            self._refresh_compute_shard(group)
        if not async_op:
            for group in groups:
                self._wait_compute_shard_refresh(group)

    def wait_gathered(self, groups: List[ParamGroup]):
        for group in groups:
            self._wait_gather(group)

    def ensure_gathered(self, groups: List[ParamGroup]):
        self.gather(groups, async_op=True)
        self.wait_gathered(groups)

    def release(self, groups: List[ParamGroup], mid_step: bool = False):
        """Drop gathered weights (strategy 3). The module's parameters are swapped for their resting placeholders
        until the next gather, also between a forward and its backward: the real ones view the released buffer
        (resting_parameters.py).

        `mid_step`: a release between a unit's forward and its backward, or within the backward. A resident group
        (sharded over one rank: its compute weights are its shard, nothing is freed) then stays gathered and shown
        until the end of the backward, instead of being hidden and shown again for each use."""
        if self.strategy != ShardingStrategy.optim_grads_params:
            return
        for group in groups:
            if (mid_step and group.resident) or id(group) in self.held_gathered:
                continue
            self._wait_gather(group)
            group.release_compute()  # a pooled group keeps its slot until another unit claims it
            if self.resting is not None:
                self.resting.hide(group)

    # ---- after the optimizer step ---------------------------------------------------------------------------------
    def install_optimized_model_weights(self):
        for group in self.groups:
            group.install_main_into_compute()
        # HFSDP: each group's refresh is waited for before its next gather at the latest.
        self.refresh_compute_shards(self.groups, async_op=self.overlap_param_gather)
        if self.strategy in (ShardingStrategy.optim, ShardingStrategy.optim_grads):
            self.start_param_sync(async_op=self.overlap_param_gather)
        elif self.strategy == ShardingStrategy.optim_grads_params:
            for group in self.groups:
                if group.gathered and group.trainable:
                    group.gathered = False
                    self.ensure_gathered([group])

    def start_param_sync(self, async_op: bool = True):
        """All-gather the compute weights of strategies 1-2 from every rank's updated shard: queued in the order
        the next forward uses them (root groups first, then the units), at most `max_param_syncs_in_flight` at
        once; waiting for a group (the forward's hooks, `wait_gathered`) moves the window up to it."""
        if self.strategy not in (ShardingStrategy.optim, ShardingStrategy.optim_grads):
            return
        forward_order = list(self.root_groups) + [group for unit in self.units for group in unit.groups]
        for group in forward_order:
            self._wait_gather(group)  # an earlier gather of it still queued or in flight lands first
        self.param_syncs_queued = [group for group in forward_order if group.trainable]
        for group in self.param_syncs_queued:
            group.note_param_sync_queued()
        self._start_queued_param_syncs()
        if not async_op:
            self.wait_gathered(self.groups)

"""How gradients are reduced: the inner and outer gradient-reduction pipeline of the schedule.

`GradReductionPipeline` is the part of `schedule.Schedule` that reduces gradients: each group's inner reduction
(all-reduce under strategy 0, reduce-scatter into the main gradients otherwise) on the reduce-scatter stream,
at most `max_reduces_in_flight` at once; with an outer dim the outer one (HSDP all-reduce, HFSDP reduce-scatter
into sub-shards) started as soon as the inner one lands; reopening reduced buffers before another microbatch
adds to them; and `finish_grad_sync`, which completes everything and hands the gradients to the optimizer. The
hooks in schedule.py decide when a group is reduced; `ParamGroup` (grad_buffers.py) holds the buffers.
"""

import torch

from . import collectives
from .distributed_data_parallel_config import ShardingStrategy
from .grad_state import GradState, OuterGradState
from .param_and_grad_buffer import ParamGroup
from .ungraded_params import agree_on_ungraded_params


# Reductions of gradient buffers smaller than this many bytes are held back and issued together, as one exchange
# over their group, once the held buffers reach this size, or when the backward ends (outside no_sync), or when
# anything waits for them (see `GradReductionPipeline.coalesce_reduce_bytes`).
COALESCE_REDUCE_BYTES = 2 * 1024 * 1024


class GradReductionPipeline:
    """Gradient reductions of a `Schedule` (mixed into it; reads the state its constructor sets up: `groups`,
    `dp_group`, `outer_group`, `streams`, `pending_reduces`, `pending_outer`, `deferred_reduces`, ...)."""

    # Strategies 2/3 without an outer dim: a reduce-scatter of fewer bytes than this is not issued at once but held
    # (its buffer taken from the group, so the next microbatch writes a fresh one) and issued as one exchange with
    # the next held ones over the same group (`collectives.reduce_scatter_coalesced`, bit-identical results) once
    # they hold this many bytes together, a synchronised backward ends (inside no_sync they wait for the next
    # microbatch's), or a reduction of theirs is waited for. The cost of a small exchange is per exchange rather
    # than per byte (on gloo about a millisecond of CPU, the same for 4 bytes as for 128 KiB), so a model of small
    # units reduces a step's units and root groups in one exchange instead of one each per microbatch; the price
    # is up to twice this many bytes of gradient buffers held longer and the reductions of those units no longer
    # overlapping the backward of the next ones. Groups of at least this size reduce as before; 0 turns holding
    # off.
    coalesce_reduce_bytes = COALESCE_REDUCE_BYTES

    # Set by `fully_shard_optimizer`: parameters no rank gave a gradient get no `.grad` (ungraded_params.py).
    # `ungraded_params_due`: a backward ran since the ranks last agreed on them.
    leaves_ungraded_params_without_grad = False
    ungraded_params_due = False

    def agree_on_ungraded_params(self):
        """Once per step, after its last backward and reductions (on every rank alike): see ungraded_params.py."""
        if self.leaves_ungraded_params_without_grad and self.ungraded_params_due:
            agree_on_ungraded_params(self.groups, self._shard_group, self._outer_group)
            self.ungraded_params_due = False

    # ---- when a group reduces -----------------------------------------------------------------------------------
    def _reduces_now(self, group: ParamGroup) -> bool:
        if self.strategy >= ShardingStrategy.optim_grads:
            return True
        return self.sync_enabled and self.sync_model_each_microbatch

    def _launch_deferred_reduces(self):
        while self.deferred_reduces:
            group = self.deferred_reduces.pop(0)
            if group.grads_dirty:
                self.launch_reduce(group, async_op=self.overlap_grad_reduce)

    def _reopen_persistent_grads(self, group: ParamGroup):
        """Strategies 0/1, before a microbatch adds to a persistent gradient buffer reduced earlier in the step: its
        inner reduction and the outer one started when it landed must be complete, and gradients already summed
        over the outer replicas are scaled so the next outer reduction counts them once (the inner reopening
        happens in ParamGroup.write_grad)."""
        if group.persistent_grads_reduced:
            self.wait_reduce_of(group)
            self._wait_outer(group)
            self._reopen_outer_reduced(group)

    # ---- reduction ----------------------------------------------------------------------------------------------
    def _reduction_batch(self, group: ParamGroup):
        """Reductions launched together and counted as one against `max_reduces_in_flight`: a unit's groups
        (together one unit's gradients, e.g. its dense and its expert parameters); each root group alone."""
        return ("unit", group.unit_index) if group.unit_index is not None else ("root", id(group))

    def _batches_in_flight_beside(self, group: ParamGroup) -> int:
        """Reduction batches in flight other than `group`'s own."""
        own = self._reduction_batch(group)
        return len({self._reduction_batch(entry[3]) for entry in self.pending_reduces} - {own})

    def _reduces_locally(self, group: ParamGroup) -> bool:
        """A group sharded over one rank (experts at expert data-parallel size 1) with no outer dim: its reduction
        is a local add into the main gradients, done at launch, and holds nothing in flight."""
        return collectives.group_size(self._shard_group(group)) == 1 and not self._has_outer()

    def launch_reduce(self, group: ParamGroup, async_op: bool):
        """Reduce one group's gradients on the reduce-scatter stream; at most `max_reduces_in_flight` batches
        (a unit's groups, or one root group: each holds up to a unit's gradient buffers) at once, the oldest
        waited for first. A local reduction (`_reduces_locally`) neither waits for nor joins them. A small one
        may be held and issued with the next ones instead (`coalesce_reduce_bytes`)."""
        group.move_grads_to(GradState.REDUCED)  # first: a reduction of nothing must not issue a collective
        if group.grads_into_main:  # its gradients were added into the main gradients as they arrived
            return
        local = self._reduces_locally(group)
        if async_op and not local and self._holds_reduce(group):
            self._hold_reduce(group)
            return
        while not local and self._batches_in_flight_beside(group) >= self.max_reduces_in_flight:
            self._wait_oldest_reduce()
        self._wait_outer(group)  # the main gradients this reduction adds to may still be in an outer reduction
        self._reopen_outer_reduced(group)
        self.note_transient(group)
        self._track_transient()
        flat = group.reduce_input()
        average = self.average_in_collective
        outer_after = False
        if self.strategy == ShardingStrategy.no_shard:
            copy_back = flat.data_ptr() != group.grad_buffer.data_ptr()
            pending = self.streams.issue(self.streams.reduce_scatter, lambda: collectives.all_reduce(
                flat, self._shard_group(group), self.counter, average=average, async_op=True))
            epilogue = (lambda: group.grad_buffer.copy_(flat)) if copy_back else None
        else:
            accumulate = self.strategy >= ShardingStrategy.optim_grads
            group.ensure_main_grads()
            pending = self.streams.issue(self.streams.reduce_scatter, lambda: collectives.reduce_scatter_flat(
                group.main_grads, flat, self._shard_group(group), self.counter, average=average,
                accumulate=accumulate, async_op=True))
            epilogue = None
            # The in-flight buffer now belongs to the collective; the next microbatch writes a fresh one.
            group.drop_transient_grads()
        if self._has_outer():
            group.move_outer_grads_to(OuterGradState.DUE)
            # a synced microbatch: the outer reduction starts as soon as this one lands, during the backward
            outer_after = self.sync_enabled
        if local:
            pending.wait()
            if epilogue is not None:
                epilogue()
            return
        self.pending_reduces.append((pending, epilogue, flat, group, outer_after))
        if not async_op:
            self.wait_reduces()

    # ---- small reductions issued together ----------------------------------------------------------------------
    def _holds_reduce(self, group: ParamGroup) -> bool:
        """Whether `group`'s reduce-scatter may wait to be issued with others (see `coalesce_reduce_bytes`)."""
        if self.strategy < ShardingStrategy.optim_grads or self._has_outer() or group.grad_buffer is not None:
            return False
        return group.layout.padded_numel * group.comm_dtype.itemsize < self.coalesce_reduce_bytes

    def _hold_reduce(self, group: ParamGroup):
        """Take `group`'s flat gradient buffer for a later reduction with others over the same group, of the same
        dtype; issue them all once they reach `coalesce_reduce_bytes`."""
        self.note_transient(group)
        flat = group.reduce_input()
        group.ensure_main_grads()
        group.drop_transient_grads()  # the buffer is the held reduction's; the next microbatch writes a fresh one
        key = (self._shard_group(group), flat.dtype, flat.device)
        held = self.held_reduces.setdefault(key, [])
        held.append((group, flat))
        self._track_transient()
        if sum(entry[1].numel() * entry[1].element_size() for entry in held) >= self.coalesce_reduce_bytes:
            self._issue_held(key)

    def issue_held_reduces(self):
        """Issue every held reduction (in the order their first reductions were held, the same on every rank)."""
        for key in list(self.held_reduces):
            self._issue_held(key)

    def _issue_held(self, key):
        held = self.held_reduces.pop(key)
        groups, flats = [entry[0] for entry in held], [entry[1] for entry in held]
        batches = {self._reduction_batch(group) for group in groups}
        while len({self._reduction_batch(entry[3]) for entry in self.pending_reduces} - batches) \
                >= self.max_reduces_in_flight:
            self._wait_oldest_reduce()
        process_group, average = key[0], self.average_in_collective
        accumulate = self.strategy >= ShardingStrategy.optim_grads
        pending = self.streams.issue(self.streams.reduce_scatter, lambda: collectives.reduce_scatter_coalesced(
            [group.main_grads for group in groups], flats, process_group, self.counter, average=average,
            accumulate=accumulate, async_op=True))
        # One entry per group, all on the same handle: waiting for any of them completes the exchange.
        self.pending_reduces.extend((pending, None, flat, group, False) for group, flat in held)

    def _wait_oldest_reduce(self):
        pending, epilogue, _, group, outer_after = self.pending_reduces.pop(0)
        pending.wait()
        if epilogue is not None:
            epilogue()
        if outer_after and group.outer_grad_state is OuterGradState.DUE:
            # The group's inner reduction has landed in its main gradients: start the outer one now, during the
            # backward, instead of all of them at the optimizer step.
            self._launch_outer(group)

    def wait_reduce_of(self, group: ParamGroup):
        """Wait for the reductions in flight up to and including `group`'s, if it has one."""
        if any(entry[0] is group for held in self.held_reduces.values() for entry in held):
            self.issue_held_reduces()
        count = max((i + 1 for i, entry in enumerate(self.pending_reduces) if entry[3] is group), default=0)
        for _ in range(count):
            self._wait_oldest_reduce()

    def wait_reduces(self):
        self.issue_held_reduces()
        while self.pending_reduces:
            self._wait_oldest_reduce()

    # ---- outer reductions (HSDP / HFSDP) ----------------------------------------------------------------------
    def _has_outer(self) -> bool:
        return self.outer_group is not None and collectives.group_size(self.outer_group) > 1

    def _launch_outer(self, group: ParamGroup):
        """Reduce `group`'s main gradients over the outer group: HSDP all-reduces them in place; HFSDP
        reduce-scatters them into this outer rank's sub-shard (added to what earlier microbatches put there) and
        then drops the shard-sized buffer."""
        group.move_outer_grads_to(OuterGradState.REDUCED)
        average = self.average_in_collective
        outer_group = self._outer_group(group)
        if group.outer_sharded:
            accumulate = group.optim_grads_written
            group.optim_grads_written = True

            def start():
                pending = collectives.reduce_scatter_flat(group.optim_grads, group.main_grads, outer_group,
                                                          self.counter, average=average, accumulate=accumulate,
                                                          async_op=True)
                return pending

            pending = self.streams.issue(self.streams.reduce_scatter, start)
            self.pending_outer[id(group)] = collectives.PendingCollective(
                epilogue=lambda: (pending.wait(), group.release_main_grads()))
        else:
            self.pending_outer[id(group)] = self.streams.issue(self.streams.reduce_scatter, lambda: (
                collectives.all_reduce(group.main_grads, outer_group, self.counter, average=average,
                                       async_op=True)))

    def _wait_outer(self, group: ParamGroup):
        pending = self.pending_outer.pop(id(group), None)
        if pending is not None:
            pending.wait()

    def wait_outer_reductions(self):
        for group in self.groups:
            self._wait_outer(group)

    def _reopen_outer_reduced(self, group: ParamGroup):
        """More gradients are about to be added after an outer reduction (a microbatch without no_sync after a
        synced one). HSDP: the main gradients hold the sum over the outer ranks; keep 1/outer of it on each so the
        next outer all-reduce counts it once. HFSDP: the next outer reduce-scatter adds to the sub-shard."""
        if group.outer_grad_state is OuterGradState.REDUCED:
            if not group.outer_sharded and not self.average_in_collective:
                group.main_grads.mul_(1.0 / collectives.group_size(self._outer_group(group)))
            group.move_outer_grads_to(OuterGradState.NONE)

    def complete_reductions(self):
        """Wait for every inner reduction in flight, start the outer reductions still due (groups last reduced
        under no_sync) and wait for them: the main gradients (HFSDP: the sub-shard gradients) are then final."""
        self.wait_reduces()
        if not self._has_outer():
            return
        for group in self.groups:
            if group.main_grads is not None and group.outer_grad_state is OuterGradState.DUE:
                self._launch_outer(group)
        self.wait_outer_reductions()

    def start_grad_sync(self):
        for group in self.groups:
            if group.grads_dirty:
                self.launch_reduce(group, async_op=True)

    def finish_grad_sync(self) -> bool:
        """Complete every gradient reduction of the step and hand the gradients to the optimizer.

        Returns False when there was nothing left to synchronise (already finished this step)."""
        for group in self.groups:  # HFSDP: the refreshes send the main weights the optimizer is about to step
            self._wait_compute_shard_refresh(group)
        if self.grads_synced:
            return False
        for group in self.groups:
            if group.grads_dirty:
                self.launch_reduce(group, async_op=self.overlap_grad_reduce)
        self.wait_reduces()
        for group in self.groups:
            if not group.outer_sharded:  # HFSDP's shard gradients stay dropped once reduced over the outer group
                group.ensure_main_grads()
        if self._has_outer():
            for group in self.groups:
                if group.main_grads is None:
                    continue
                # Outer reductions started during the backward; only groups last reduced under no_sync (or
                # here, outside a synced microbatch) still need one.
                if group.outer_grad_state is OuterGradState.DUE:
                    self._launch_outer(group)
                elif group.outer_sharded and not group.optim_grads_written:
                    group.optim_grads.zero_()  # no gradient reached this group in the step
                    group.optim_grads_written = True
            self.wait_outer_reductions()
        if self.report_nan_in_param_grad:
            self._raise_on_nan_grads()
        self.agree_on_ungraded_params()
        for group in self.groups:
            group.attach_optimizer_grads()
        self.grads_synced = True
        return True

    def _raise_on_nan_grads(self):
        """After the reductions: raise on every rank alike if any rank's reduced gradients hold a NaN.

        Checking each rank's own gradients inside the backward would raise on that rank only and leave the
        others waiting in the next collective; one flag per parameter, max-reduced over every group that splits
        the gradients, gives all ranks the same verdict and the same parameter names."""
        names = [name for group in self.groups if group.optim_grads is not None for name in group.names]
        flags = [torch.isnan(grad).any() for group in self.groups if group.optim_grads is not None
                 for grad in group.reduced_grad_views()]
        if not flags:
            return
        flags = torch.stack(flags).to(torch.float32)
        for process_group in self.nan_check_groups:
            collectives.all_reduce_max(flags, process_group)
        bad = [name for name, flag in zip(names, flags.tolist()) if flag]
        if bad:
            raise RuntimeError(f"NaN in the reduced gradients of {len(bad)} parameter(s): {bad} "
                               "(report_nan_in_param_grad=True); the step was not taken. Look for an overflow "
                               "or a division by zero in the loss or the model's forward.")

    def zero_grad_buffer(self):
        self.wait_reduces()
        self.wait_outer_reductions()
        self.grads_synced = False
        for group in self.groups:
            group.zero_grads()

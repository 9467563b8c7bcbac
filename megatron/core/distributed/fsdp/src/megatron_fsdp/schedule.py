"""When to gather, release and reduce: the forward/backward hooks of Megatron-FSDP.

One step under strategy 3 (units U0..Un in forward order, R = parameters outside units):

    forward:  gather R | pre-fwd U0: wait/gather U0, prefetch U1 | U0 fwd | post-fwd U0: release U0 | ... |
              post-fwd Un: keep Un gathered (its backward comes first)
              (small units: a prefetch takes the next units along, one exchange for them all, and the last
              units within that budget stay gathered for their backward: gather_policy.py's coalesce_gather_bytes)
    backward: loss grad: gather R if released | pre-bwd Un (grad of Un's outputs): wait/gather Un, prefetch Un-1 |
              Un's first gradient: wait for the reduction in flight | Un bwd |
              all grads of a group written -> reduce-scatter it (async if overlapping; a small one is held and
              issued with the next ones, inside no_sync with the next microbatch's: grad_reduction.py's
              coalesce_reduce_bytes), release its weights
              (R's groups too) | ... | end of backward: reduce leftovers, release anything still gathered
              (inside no_sync R and U0 stay gathered: the next microbatch's forward starts with them)
    step:     finish_grad_sync (wait reduces) -> optimizer.step on shards -> write shards into compute shards

With an outer dim, each group's outer reduction starts on the reduce-scatter stream as soon as its inner reduction
of a synced microbatch has landed, while the rest of the backward runs (every strategy): HSDP all-reduces the main
gradients over the outer group, HFSDP reduce-scatters them into sub-shards. A later microbatch that adds to them
first waits for it and reopens them (strategies 0/1 before writing into the persistent buffer, 2/3 before the
next reduction); `finish_grad_sync` only launches the ones still due (microbatches reduced under no_sync). After
the step, HFSDP rebuilds each compute shard by an all-gather of the outer ranks' main-weight sub-shards (async
with `overlap_param_gather`), waited for before that group's gather. Gradient states: grad_state.py.

Strategies 0-2 keep the compute weights gathered; their gathers happen after the optimizer step
(strategies 1-2, async when `overlap_param_gather`, waited in the next forward), two groups in flight at a time
in the order the forward uses them, so their gather buffers never exist for the whole model at once.
Strategies 0/1 reduce their persistent gradient buffers only when sync is enabled (not inside `no_sync()` and,
with `sync_model_each_microbatch=False`, only at `finish_grad_sync`).

Where each part lives: this module holds the schedule's state and its hooks (registration, forward, backward,
the post-backward node on a unit's inputs); `gather_policy.py` gathers and releases weights; `grad_reduction.py`
reduces gradients. `Schedule` combines the three.
"""

from typing import Dict, List, Optional

import torch

from . import collectives
from .distributed_data_parallel_config import ShardingStrategy
from .gather_policy import GatherReleasePolicy
from .grad_reduction import GradReductionPipeline
from .param_and_grad_buffer import DoubleBufferPool, ParamGroup
from .streams import CommunicationStreams
from .utils import (current_graph_task_id, in_backward_pass, queue_end_of_backward_callback, register_first_grad_hook,
                    run_eagerly, tensors_requiring_grad)


class Unit:
    """An FSDP unit: a module whose parameter groups are gathered and released together. `call_module` is what
    the model calls to run it: the module, or the wrapper that `torch.compile` / `checkpoint_wrapper` put
    around it before wrapping (utils.unit_call_module); its hooks are the unit's."""

    def __init__(self, index: int, module: torch.nn.Module, groups: List[ParamGroup],
                 call_module: Optional[torch.nn.Module] = None):
        self.index, self.module, self.groups = index, module, groups
        self.call_module = module if call_module is None else call_module


class Schedule(GatherReleasePolicy, GradReductionPipeline):
    """Owns the hooks and every collective issued during a step (gathers and releases: GatherReleasePolicy;
    reductions: GradReductionPipeline)."""

    # Set by MegatronFSDP: under strategy 3, swaps released groups' parameters for placeholders while at rest;
    # shows the reduced gradients as the parameters' `.grad` (param_grads.py).
    resting = None
    param_grads = None

    def __init__(self, *, units: List[Unit], root_groups: List[ParamGroup], strategy: ShardingStrategy,
                 dp_group, outer_group, counter: collectives.CommunicationCounter, grad_scale: float,
                 average_in_collective: bool, overlap_grad_reduce: bool, overlap_param_gather: bool,
                 sync_model_each_microbatch: bool, report_nan_in_param_grad: bool,
                 pool: Optional[DoubleBufferPool], tp_group=None, device: Optional[torch.device] = None,
                 expert_grad_scale: Optional[float] = None, expert_group=None):
        """Each group is gathered and reduced over its own shard group (`group.topology.dp_group`): `dp_group`
        for dense groups, `expert_group` (the expert data-parallel ranks) for expert ones, whose local gradients
        are multiplied by `expert_grad_scale` (default `grad_scale`) instead of `grad_scale`."""
        self.units, self.root_groups = units, root_groups
        self.groups = [g for unit in units for g in unit.groups] + list(root_groups)
        self.strategy = strategy
        self.dp_group, self.outer_group = dp_group, outer_group
        self.counter = counter
        self.grad_scale = grad_scale
        self.expert_grad_scale = grad_scale if expert_grad_scale is None else expert_grad_scale
        self.average_in_collective = average_in_collective
        self.overlap_grad_reduce, self.overlap_param_gather = overlap_grad_reduce, overlap_param_gather
        self.sync_model_each_microbatch = sync_model_each_microbatch
        self.report_nan_in_param_grad = report_nan_in_param_grad
        self.nan_check_groups = [g for g in (dp_group, outer_group, tp_group) if g is not None]
        self.pool = pool
        self.sync_enabled = True
        # HFSDP: in-flight all-gathers over the outer group into compute shards, with the tensor they send.
        self.pending_shard_refreshes: Dict[int, tuple] = {}
        # Strategies 1/2: the post-step all-gathers run through a window of `max_param_syncs_in_flight` (each
        # holds a staging buffer and the shard it sends); the rest wait in forward order and start as earlier
        # ones are waited for, so at most that many groups' gather buffers exist at once.
        self.max_param_syncs_in_flight = 2
        self.param_syncs_queued: List[ParamGroup] = []
        self.param_syncs_in_flight: List[ParamGroup] = []
        self.pending_reduces: List[tuple] = []  # (handle, epilogue, flat input, group), oldest first
        # Reductions in flight at once, counted in batches (a unit's groups together, or one root group; see
        # GradReductionPipeline.launch_reduce): launching one of another batch first waits for the oldest. One
        # batch in flight while the next unit's backward computes is the overlap; each holds a unit's gradients.
        self.max_reduces_in_flight = 1
        # Small reductions held to be issued together (GradReductionPipeline.coalesce_reduce_bytes): per (process
        # group, dtype, device), the groups and the flat buffers they reduce, in the order they were held.
        self.held_reduces: Dict[tuple, List[tuple]] = {}
        # With an outer dim: outer reductions (HSDP all-reduce, HFSDP reduce-scatter) in flight, issued during the
        # backward as soon as a group's inner reduction has landed, by group id.
        self.pending_outer: Dict[int, collectives.PendingCollective] = {}
        self.deferred_reduces: List[ParamGroup] = []  # root groups whose reduction waits for a unit boundary
        self.streams = CommunicationStreams(device if device is not None else torch.device("cpu"))
        # The backward starts with the last unit of the forward: it stays gathered from its forward to its
        # backward (one unit's weights held through the loss) instead of being released and gathered again.
        self.keep_last_unit_for_backward = True
        # Inside no_sync() another microbatch of the step follows with the same weights, and its forward starts by
        # gathering the root groups and the first unit, the last ones this backward releases: they stay gathered
        # across the boundary instead (no more weights are held than that forward holds at its start). A step's
        # install of new weights or a load re-gathers whatever is still gathered.
        self.keep_first_unit_between_microbatches = True
        self.post_backward_queued = False
        self.before_backward = None  # called at the start of each outermost backward, before any gradient arrives
        self.backward_task = None  # graph task of the step's outermost backward
        self.grads_synced = False  # finish_grad_sync already ran and no gradient arrived since
        self.peak_transient_bytes = 0
        # The groups that may hold transient bytes (see _track_transient), by id: noted where the schedule makes
        # a group allocate (a gather, a gradient written, a reduction), dropped once found holding none; HFSDP's
        # outer-sharded groups (whose shard gradients come and go with the optimizer step) always counted.
        self.transient_holders: Dict[int, ParamGroup] = {}
        self.always_counted = [group for group in self.groups if group.outer_sharded]
        self.hook_handles = []
        for group in self.groups:
            group.grads_into_main = (group.resident and group.trainable and self._reduces_locally(group)
                                     and group.comm_dtype == group.grad_dtype)
            inner = collectives.group_size(self._shard_group(group))
            if strategy == ShardingStrategy.no_shard:
                group.reopen_factor = 1.0 if average_in_collective else 1.0 / inner
            elif strategy == ShardingStrategy.optim:
                group.reopen_factor = float(inner) if average_in_collective else 1.0

    # ---- registration -----------------------------------------------------------------------------------------
    def register_hooks(self):
        """Forward hooks on each unit's call module (the unit, or the compiled / checkpoint wrapper around it),
        run eagerly where compiled code calls them; gradient hooks on the parameters of the root groups."""
        for unit in self.units:
            self.hook_handles.append(unit.call_module.register_forward_pre_hook(
                run_eagerly(self._make_pre_forward(unit)), with_kwargs=True))
            self.hook_handles.append(unit.call_module.register_forward_hook(run_eagerly(self._make_post_forward(unit))))
        for group in self.groups:
            if not group.trainable or self._collects_grads_at_unit_end(group):
                continue
            for index, param in enumerate(group.params):
                self.hook_handles.append(param.register_post_accumulate_grad_hook(self._make_grad_hook(group, index)))

    @staticmethod
    def _collects_grads_at_unit_end(group: ParamGroup) -> bool:
        """A unit's group needs no hook per parameter: autograd accumulates into `.grad` through the unit's
        backward, and the unit's post-backward (or, for a gradient that arrives later, the end of the backward)
        writes them all at once (`_add_accumulated_grads`) into its transient gradient buffer, the main gradients
        of a resident group, or the persistent buffer of strategies 0/1 (after waiting for a reduction of it
        still in flight). Root groups keep their hooks: they are reduced as soon as their last gradient arrives."""
        return group.unit_index is not None

    def _add_accumulated_grads(self, groups):
        for group in groups:
            if not self._collects_grads_at_unit_end(group):
                continue
            indices, grads = [], []
            for index, param in enumerate(group.params):
                if param.grad is not None:
                    indices.append(index)
                    grads.append(param.grad)
                    param.grad = None
            if grads:
                # strategies 0/1: a reduction of the buffer still in flight (the unit's pre-backward normally
                # waited for it already) lands before more is added
                self._reopen_persistent_grads(group)
                self.note_transient(group)
                scale = self.expert_grad_scale if group.expert else self.grad_scale
                group.take_accumulated_grads(indices, grads, scale)
                self.grads_synced = False

    def remove_hooks(self):
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles = []

    # ---- reporting ----------------------------------------------------------------------------------------------
    def note_transient(self, group: ParamGroup):
        """`group` is about to allocate transient memory (gathered weights, gradient buffers)."""
        if not group.outer_sharded:  # those are always counted
            self.transient_holders[id(group)] = group

    def _track_transient(self):
        """Update the peak of transient bytes: gathered weights and their staging, gradient buffers, reductions
        in flight and the pool. Summed over the groups noted as holders since they last held nothing, not over
        every group: with many units the full sum at every gather would cost the host time quadratic in them."""
        current = sum(group.transient_bytes() for group in self.always_counted)
        idle = []
        for key, group in self.transient_holders.items():
            held = group.transient_bytes()
            if held:
                current += held
            else:
                idle.append(key)
        for key in idle:
            del self.transient_holders[key]
        current += sum(entry[2].numel() * entry[2].element_size() for entry in self.pending_reduces
                       if entry[2] is not entry[3].grad_buffer)
        current += sum(flat.numel() * flat.element_size() for held in self.held_reduces.values() for _, flat in held)
        if self.pool is not None:
            current += self.pool.total_bytes()
        self.peak_transient_bytes = max(self.peak_transient_bytes, current)

    # ---- forward ------------------------------------------------------------------------------------------------
    def root_pre_forward(self):
        if self.strategy == ShardingStrategy.optim_grads_params:
            prefetched = self._units_ahead(0, 1) if self.overlap_param_gather and self.units else []
            self.gather(list(self.root_groups) + prefetched, async_op=True)
        self.wait_gathered(self.root_groups)

    def root_post_forward(self, output):
        tensors = tensors_requiring_grad(output) if torch.is_grad_enabled() else []
        if tensors:
            register_first_grad_hook(tensors, self._root_pre_backward)
        elif not torch.is_grad_enabled():
            self.release(self.root_groups)

    def _make_pre_forward(self, unit: Unit):
        def pre_forward(module, args, kwargs):
            self.ensure_gathered(unit.groups)
            # The unit's post-backward runs when the gradients of its inputs are computed, i.e. once its whole
            # backward is done. Under reentrant activation checkpointing the first forward runs without grad
            # and the recompute (inside the backward) attaches the node to the inner backward instead.
            routed = _route_inputs_through_post_backward(args, kwargs, lambda: self._unit_post_backward(unit))
            if in_backward_pass():
                return routed
            if self.overlap_param_gather and self.strategy == ShardingStrategy.optim_grads_params:
                if unit.index + 1 < len(self.units):
                    self.gather(self._units_ahead(unit.index + 1, 1), async_op=True)
            return routed

        return pre_forward

    def _make_post_forward(self, unit: Unit):
        def post_forward(module, args, output):
            if in_backward_pass():
                return None  # activation-checkpoint recompute: the unit stays gathered for its backward
            tensors = tensors_requiring_grad(output) if torch.is_grad_enabled() else []
            if not (tensors and self._stays_gathered_for_backward(unit)):
                self.release(unit.groups, mid_step=bool(tensors))
            if tensors:
                register_first_grad_hook(tensors, lambda: self._unit_pre_backward(unit))
            return None

        return post_forward

    # ---- backward -----------------------------------------------------------------------------------------------
    def _queue_post_backward(self):
        if not self.post_backward_queued:
            if self.before_backward is not None:
                self.before_backward()
            self.post_backward_queued = True
            self.backward_task = current_graph_task_id()
            queue_end_of_backward_callback(self._post_backward)

    def _root_pre_backward(self):
        # Queued from the outermost backward: a reentrant activation-checkpoint backward nested in it must not
        # end the step's backward early.
        self._queue_post_backward()
        self._drop_param_grads()
        for group in self.root_groups:  # strategies 0/1: as in _unit_pre_backward, not in the gradient hooks
            self._reopen_persistent_grads(group)
        if self.strategy == ShardingStrategy.optim_grads_params:
            # The last unit is not prefetched here: the start of backward is where activations peak, and the
            # unit's own pre-backward hook gathers it once the loss and output-layer gradients are done.
            self.ensure_gathered(self.root_groups)

    def _drop_param_grads(self):
        """Before any gradient of a backward accumulates: `.grad` attached after the last one views reduced
        gradients, which autograd would add this backward's gradients to."""
        if self.param_grads is not None:
            self.param_grads.drop()

    def _unit_pre_backward(self, unit: Unit):
        self._queue_post_backward()
        self._drop_param_grads()
        self._launch_deferred_reduces()
        for group in unit.groups:  # strategies 0/1: this microbatch adds to buffers the last one may still reduce
            self._reopen_persistent_grads(group)
        if self.strategy != ShardingStrategy.optim_grads_params:
            return
        self.ensure_gathered(unit.groups)
        if self.overlap_param_gather and unit.index > 0:
            self.gather(self._units_ahead(unit.index - 1, -1), async_op=True)

    def _units_ahead(self, index: int, direction: int) -> List[ParamGroup]:
        """The groups to prefetch for unit `index`: its own and, when it is still to be gathered and its
        gathers coalesce (`coalesce_gather_bytes`), those of the units after it in `direction` (+1 forward, -1
        backward) while their weights together stay under that many bytes: one exchange for them all."""
        groups = list(self.units[index].groups)
        if not self._unit_coalesces(index) or all(group.gathered for group in groups if not group.resident):
            return groups
        ahead_bytes, following = 0, index + direction
        while 0 <= following < len(self.units) and self._unit_coalesces(following):
            ahead_bytes += sum(self._gather_bytes(group) for group in self.units[following].groups
                               if not group.resident)
            if ahead_bytes > self.coalesce_gather_bytes:
                break
            groups += self.units[following].groups
            following += direction
        return groups

    def _stays_gathered_for_backward(self, unit: Unit) -> bool:
        """Whether `unit` keeps its weights from its forward to its backward instead of being released and gathered
        again (`keep_last_unit_for_backward`): the last unit, and the small units before it whose backward follows
        (those whose gathers coalesce, from the second-to-last backwards while their weights together stay under
        `coalesce_gather_bytes`: the budget a prefetch may gather ahead of use)."""
        if not self.keep_last_unit_for_backward:
            return False
        return unit is self.units[-1] or unit.index >= self._first_unit_kept_for_backward()

    def _first_unit_kept_for_backward(self) -> int:
        key = self.coalesce_gather_bytes
        if getattr(self, "_kept_for_backward_key", None) != key:
            first, kept_bytes = len(self.units) - 1, 0
            while first > 0 and self._unit_coalesces(first - 1):
                kept_bytes += sum(self._gather_bytes(group) for group in self.units[first - 1].groups
                                  if not group.resident)
                if kept_bytes > self.coalesce_gather_bytes:
                    break
                first -= 1
            self._kept_for_backward_key, self._first_kept_for_backward = key, first
        return self._first_kept_for_backward

    def _unit_coalesces(self, index: int) -> bool:
        """Whether every group of unit `index` that moves bytes when gathered can join a coalesced exchange."""
        return bool(self.coalesce_gather_bytes) and all(
            group.resident or self._gathers_coalesced(group) for group in self.units[index].groups)

    def _make_grad_hook(self, group: ParamGroup, index: int):
        def on_grad_accumulated(param):
            grad = param.grad
            if grad is None:
                return
            # strategies 0/1: another gradient for a persistent buffer whose reduction may be in flight (the
            # unit's pre-backward waits for it first, so this is normally a no-op)
            self._reopen_persistent_grads(group)
            self.note_transient(group)
            group.write_grad(index, grad, self.expert_grad_scale if group.expert else self.grad_scale)
            param.grad = None
            self.grads_synced = False
            if group.unit_index is None:
                self._count_root_grad(group, index)

        return on_grad_accumulated

    def _count_root_grad(self, group: ParamGroup, index: int):
        """Root groups have no module of their own whose backward ends before the model's: they are reduced and
        released once each trainable parameter's gradient arrived once in the step's own backward. A gradient
        accumulated in a nested (reentrant checkpoint) backward may arrive again, so such a group waits for the
        end of the backward instead."""
        if current_graph_task_id() != self.backward_task:
            group.early_release_blocked = True
        if group.early_release_blocked or index in group.grads_received:
            return
        group.grads_received.add(index)
        if len(group.grads_received) == group.trainable_count():
            self._on_group_grads_ready(group)

    def _unit_post_backward(self, unit: Unit):
        """Every gradient of the unit has been computed: reduce its groups and release its weights (strategy 3),
        whether or not each parameter got a gradient (unused and frozen parameters do not hold the unit)."""
        self._add_accumulated_grads(unit.groups)
        self._launch_deferred_reduces()
        for group in unit.groups:
            if group.grads_dirty and self._reduces_now(group):
                self.launch_reduce(group, async_op=self.overlap_grad_reduce)
        if not (unit.index == 0 and self._holds_for_next_microbatch()):
            self.release(unit.groups, mid_step=True)

    def _holds_for_next_microbatch(self) -> bool:
        """Whether the root groups and the first unit stay gathered at the end of this backward (see
        `keep_first_unit_between_microbatches`)."""
        return (self.keep_first_unit_between_microbatches and not self.sync_enabled
                and self.strategy == ShardingStrategy.optim_grads_params)

    def _on_group_grads_ready(self, group: ParamGroup):
        """A root group got all its gradients (called from a gradient hook). Its reduction starts now if that
        needs no wait for another one in flight; otherwise at the next unit boundary or the end of the backward,
        so that no gradient hook waits for a reduction."""
        if self._reduces_now(group):
            if self._reduces_locally(group) or self._batches_in_flight_beside(group) < self.max_reduces_in_flight:
                self.launch_reduce(group, async_op=self.overlap_grad_reduce)
            else:
                self.deferred_reduces.append(group)
        # Every parameter of the group has its gradient: its weights are not needed again in this backward
        # (a root group too; the next forward or backward gathers it again, unless it stays gathered for the next
        # microbatch).
        if not self._holds_for_next_microbatch():
            self.release([group], mid_step=True)

    def held_for_next_microbatch(self) -> List[ParamGroup]:
        """The root groups, the first unit's groups, and every resident group (whose weights are its shard)."""
        held = list(self.root_groups) + (list(self.units[0].groups) if self.units else [])
        return held + [group for group in self.groups if group.resident and not any(group is kept for kept in held)]

    def _post_backward(self):
        self.post_backward_queued = False
        self.ungraded_params_due = True
        self._add_accumulated_grads(self.groups)
        self._launch_deferred_reduces()
        for group in self.groups:
            if group.grads_dirty and self._reduces_now(group):
                self.launch_reduce(group, async_op=self.overlap_grad_reduce)
        if self.sync_enabled:
            self.issue_held_reduces()  # the backward's last small reductions, together
        # Inside no_sync() they stay held: the next microbatch's reductions of the same groups join them, one
        # exchange for the step's instead of one per microbatch (up to `coalesce_reduce_bytes` held at once).
        if self.strategy == ShardingStrategy.optim_grads_params:
            held = self.held_for_next_microbatch() if self._holds_for_next_microbatch() else []
            self.release([group for group in self.groups if not any(group is kept for kept in held)])
        if any(entry[4] for entry in self.pending_reduces):
            self.wait_reduces()  # the last inner reductions landed: their outer ones start before the step
        if self.sync_enabled and self.sync_model_each_microbatch and not any(g.grads_dirty for g in self.groups):
            # A synchronised microbatch (the last of the step): every reduction was launched; once they and the
            # outer ones have landed, `.grad` shows the step's gradients (param_grads.py).
            self.complete_reductions()
            if self.param_grads is not None:
                self.agree_on_ungraded_params()
                self.param_grads.attach()
        for group in self.groups:
            group.grads_received = set()
            group.early_release_blocked = False


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs `callback` once the gradients of the inputs exist, i.e.
    after the whole unit's backward (its parameters' gradients are accumulated before: AccumulateGrad nodes run
    as soon as they are ready, and this node was created before any node of the unit)."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tuple(tensor.view_as(tensor) for tensor in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None,) + grads


def _route_inputs_through_post_backward(args, kwargs, callback):
    """(args, kwargs) with every input tensor that requires grad passed through one `_PostBackward` node, or None
    (leave the inputs alone) when no input requires grad or grad mode is off."""
    if not torch.is_grad_enabled():
        return None
    if not kwargs and all(isinstance(arg, torch.Tensor) for arg in args):  # the common call: tensors only
        positions = [i for i, arg in enumerate(args) if arg.requires_grad]
        if not positions:
            return None
        routed, leaves = _PostBackward.apply(callback, *(args[i] for i in positions)), list(args)
        for position, tensor in zip(positions, routed):
            leaves[position] = tensor
        return tuple(leaves), kwargs
    if not any(_is_tree_node(value) for value in args) and not any(_is_tree_node(value) for value in kwargs.values()):
        # tensors and other leaves passed positionally and by keyword (a transformer layer's call): the same
        # leaves as the tree walk below finds, without it
        names = list(kwargs)
        values = list(args) + [kwargs[name] for name in names]
        positions = [i for i, value in enumerate(values) if isinstance(value, torch.Tensor) and value.requires_grad]
        if not positions:
            return None
        for position, tensor in zip(positions, _PostBackward.apply(callback, *(values[i] for i in positions))):
            values[position] = tensor
        return tuple(values[:len(args)]), dict(zip(names, values[len(args):]))
    leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
    if not positions:
        return None
    routed = _PostBackward.apply(callback, *(leaves[i] for i in positions))
    for position, tensor in zip(positions, routed):
        leaves[position] = tensor
    return torch.utils._pytree.tree_unflatten(leaves, spec)


def _is_tree_node(value) -> bool:
    """Whether torch's pytree walks into `value` (a tuple, list, dict or other registered container)."""
    return isinstance(value, (tuple, list, dict)) or type(value) in torch.utils._pytree.SUPPORTED_NODES

"""A parameter group's gradient buffers: where gradients are written, reduced from, and handed to the optimizer.

`GroupGrads` is the part of `param_and_grad_buffer.ParamGroup` that holds gradients: a unit's gradients are
written into the flat gradient buffer (the persistent one of strategies 0/1, or a transient one per reduction
under 2/3) in one batch at the end of the unit's backward, a root group's one at a time by the post-accumulate-grad
hook (with small early gradients stashed until the transient buffer is worth allocating),
`reduce_input` hands the schedule the buffer to reduce, and the main gradients (or their HFSDP sub-shard) become
the `.grad` of the optimizer's main-weight views. Under strategies 2/3 the shard-sized main gradients give their
storage back between `zero_grad` and the next backward's first reduction. The buffers are allocated by
`ParamGroup.__init__`; the gradient state machines are in grad_state.py.
"""

from typing import List

import torch

from .distributed_data_parallel_config import ShardingStrategy
from .grad_state import GradState, OuterGradState, checked_transition
from .resharding import copy_grad_in, even_copy_views, zero_param_chunks


class GroupGrads:
    """Gradient buffers and gradient state of a `ParamGroup` (mixed into it; reads the buffers its constructor
    sets up: `grad_buffer`, `main_grads`, `optim_grads`, `transient_grads`, ...)."""

    # A gradient smaller than 1/STASH_FRACTION of a root group that arrives before the flat transient buffer
    # exists is kept aside instead of allocating the buffer (a root group's norm gradient arriving long before its
    # embedding gradient, say). A unit's gradients all arrive within the unit's backward, so its buffer is
    # allocated with the first one: stashing them would only copy each gradient twice (and hold it twice).
    STASH_FRACTION = 8

    # Set by the schedule for a resident group (one rank, no outer dim) whose communication dtype is its gradient
    # dtype: its "reduction" would only add the flat buffer into the main gradients, so gradients are added
    # there directly: a root group's as they arrive (`write_grad`), a unit's all at once after the unit's
    # backward (`take_accumulated_grads`).
    grads_into_main = False

    # ---- gradient state --------------------------------------------------------------------------------------
    def move_grads_to(self, state: GradState):
        self.grad_state = checked_transition(self.grad_state, state, self.names[0])

    def move_outer_grads_to(self, state: OuterGradState):
        self.outer_grad_state = checked_transition(self.outer_grad_state, state, self.names[0])

    @property
    def grads_dirty(self) -> bool:
        """Local gradients are present that no reduction has taken yet."""
        return self.grad_state is GradState.ACCUMULATING

    @property
    def persistent_grads_reduced(self) -> bool:
        """Strategies 0/1: a reduction of the persistent buffer was issued this step and no gradient was added
        since; adding more first needs that reduction (and any outer one) complete, and the buffer reopened."""
        return self.grad_buffer is not None and self.grad_state is GradState.REDUCED

    # ---- gradients -------------------------------------------------------------------------------------------
    def write_grad(self, index: int, grad: torch.Tensor, scale: float):
        """Add (or, in a fresh transient buffer, write) one parameter's gradient into the flat gradient buffer:
        param-major under strategy 0 (all-reduced), else rank-major, ready for the reduce-scatter (the
        copy-in, `resharding.copy_grad_in`)."""
        self.grad_marks.mark((index,))
        if self.grads_into_main:  # a resident group reduced locally: nothing to reduce, add where it ends up
            self.ensure_main_grads()
            copy_grad_in(self.layout, self.main_grads, index, grad, scale, accumulate=True)
        elif self.grad_buffer is not None:
            if self.grad_state is GradState.REDUCED:
                self._reopen_reduced_grads()
            if self.strategy == ShardingStrategy.no_shard:
                span = self.layout.spans[index]
                target = self.grad_buffer[span.flat_start:span.flat_end]
                flat_grad = grad.reshape(-1)
                target.add_(flat_grad, alpha=scale) if scale != 1.0 else target.add_(flat_grad)
            else:
                copy_grad_in(self.layout, self.grad_buffer, index, grad, scale, accumulate=True)
        else:
            if self.transient_grads is None and not self.starts_transient_grads(grad):
                self._stash_grad(index, grad.reshape(-1), scale)
                self._mark_accumulating()
                return
            self._allocate_transient_grads()
            copy_grad_in(self.layout, self.transient_grads, index, grad, scale, accumulate=self.filled[index])
            self.filled[index] = True
        self._mark_accumulating()

    def take_accumulated_grads(self, indices: List[int], grads: List[torch.Tensor], scale: float):
        """A unit group's gradients that autograd accumulated in `.grad` during the unit's backward (such a group
        has no hook per parameter, see `Schedule.register_hooks`), written in one batch as `write_grad` would
        write them one at a time, each multiplied by `scale`: a resident group's are added into its main
        gradients, a persistent buffer's (strategies 0/1) added into it (reopened first if a reduction of this
        step already took it), any other's copied into the flat transient buffer (rank-major, ready for the
        reduce-scatter)."""
        self.grad_marks.mark(indices)
        if self.grads_into_main:
            self.ensure_main_grads()
            self._add_all([self._main_grad_target(index) for index in indices], grads, scale)
        elif self.grad_buffer is not None:
            if self.grad_state is GradState.REDUCED:
                self._reopen_reduced_grads()
            if self.strategy == ShardingStrategy.no_shard:  # param-major: each gradient onto its span, as it is
                self._add_all([self._persistent_grad_target(index) for index in indices], grads, scale)
            else:  # rank-major: each gradient's chunks, as `write_grad` adds them
                targets, sources = [], []
                for index, grad in zip(indices, grads):
                    even = even_copy_views(self.layout, self.grad_buffer, index, grad)
                    if even is None:  # padded: one at a time
                        copy_grad_in(self.layout, self.grad_buffer, index, grad, scale, accumulate=True)
                    else:
                        targets.append(even[0])
                        sources.append(even[1])
                if targets:
                    self._add_all(targets, sources, scale)
        else:
            self._allocate_transient_grads()
            targets, sources = [], []
            for index, grad in zip(indices, grads):
                even = None if self.filled[index] else even_copy_views(self.layout, self.transient_grads, index, grad)
                if even is None:  # padded, or added to an earlier gradient: one at a time
                    copy_grad_in(self.layout, self.transient_grads, index, grad, scale, accumulate=self.filled[index])
                else:
                    targets.append(even[0])
                    sources.append(even[1])
                self.filled[index] = True
            if targets:
                torch._foreach_copy_(targets, sources)
                if scale != 1.0:
                    torch._foreach_mul_(targets, scale)
        self._mark_accumulating()

    @staticmethod
    def _add_all(targets: List[torch.Tensor], sources: List[torch.Tensor], scale: float):
        if scale != 1.0:
            torch._foreach_add_(targets, sources, alpha=scale)
        else:
            torch._foreach_add_(targets, sources)

    def _persistent_grad_target(self, index: int) -> torch.Tensor:
        """Parameter `index`'s span of the param-major persistent gradient buffer (strategy 0), in its shape."""
        target = self._persistent_grad_targets.get(index)
        if target is None:
            span = self.layout.spans[index]
            target = self.grad_buffer[span.flat_start:span.flat_end].view(span.shape)
            self._persistent_grad_targets[index] = target
        return target

    def _main_grad_target(self, index: int) -> torch.Tensor:
        """Parameter `index`'s main gradient in its own shape (a group held whole by its one rank), built once: the
        view stays valid while the buffer is released and given its storage back."""
        cached = self._main_grad_targets.get(index)
        if cached is None or cached[0] is not self.main_grads:
            span, offset = self.layout.spans[index], self.layout.chunks[index].shard_offset
            cached = (self.main_grads, self.main_grads[offset:offset + span.numel].view(span.shape))
            self._main_grad_targets[index] = cached
        return cached[1]

    def _mark_accumulating(self):
        if self.grad_state is not GradState.ACCUMULATING:
            self.move_grads_to(GradState.ACCUMULATING)

    def starts_transient_grads(self, grad: torch.Tensor) -> bool:
        """Whether writing `grad` now allocates the flat transient gradient buffer."""
        if self.grad_buffer is not None or self.transient_grads is not None:
            return False
        return self.unit_index is not None or grad.numel() * self.STASH_FRACTION >= self.layout.numel

    def _stash_grad(self, index: int, flat_grad: torch.Tensor, scale: float):
        """Keep a small gradient aside until a large one makes the flat transient buffer worth allocating."""
        scaled = flat_grad.to(self.comm_dtype, copy=True)
        if scale != 1.0:
            scaled.mul_(scale)
        previous = self.stashed_grads.get(index)
        self.stashed_grads[index] = scaled if previous is None else previous.add_(scaled)

    def _allocate_transient_grads(self):
        """Create the flat transient gradient buffer (once per reduction) and move stashed gradients into it."""
        if self.transient_grads is not None:
            return
        with self.transient_allocation():
            self.transient_grads = torch.empty(self.layout.padded_numel, dtype=self.comm_dtype, device=self.device)
        self.filled = [False] * len(self.params)
        for index, stashed in self.stashed_grads.items():
            copy_grad_in(self.layout, self.transient_grads, index, stashed, 1.0, accumulate=False)
            self.filled[index] = True
        self.stashed_grads = {}

    def _reopen_reduced_grads(self):
        """Make an already-reduced persistent buffer accept more local gradients (another microbatch)."""
        if self.strategy == ShardingStrategy.optim:
            shard_start, shard_end = self.layout.shard_range(self.dp_rank)
            self.grad_buffer[:shard_start].zero_()
            self.grad_buffer[shard_end:].zero_()
            target = self.main_grads
        else:
            target = self.grad_buffer
        if self.reopen_factor != 1.0:
            target.mul_(self.reopen_factor)

    def reduce_input(self) -> torch.Tensor:
        """The flat buffer to reduce: transient grads with unwritten spans zeroed, or the persistent buffer."""
        if self.grad_buffer is not None:
            return self.grad_buffer if self.comm_dtype == self.grad_dtype else self.grad_buffer.to(self.comm_dtype)
        self._allocate_transient_grads()
        for index, was_filled in enumerate(self.filled):
            if not was_filled:
                zero_param_chunks(self.layout, self.transient_grads, index)
        layout = self.layout
        if layout.used_shard_numel < layout.shard_numel:  # the tail pad of every shard
            self.transient_grads.view(layout.dp_size, layout.shard_numel)[:, layout.used_shard_numel:].zero_()
        return self.transient_grads

    def drop_transient_grads(self):
        self.transient_grads = None
        self.stashed_grads = {}
        self.filled = [False] * len(self.params)

    def release_main_grads(self):
        """Drop the storage of an all-zero shard gradient buffer (strategies 2/3); views stay registered."""
        if self.releases_main_grads and not self.main_grads_released:
            self.main_grads.untyped_storage().resize_(0)
            self.main_grads_released = True

    def ensure_main_grads(self):
        """Give a released shard gradient buffer its storage back, zeroed, before anything reads or adds to it."""
        if self.main_grads_released:
            with self.transient_allocation():
                self.main_grads.untyped_storage().resize_(self.main_grads.numel() * self.main_grads.element_size())
            self.main_grads.zero_()
            self.main_grads_released = False

    def zero_grads(self):
        if self.grad_buffer is not None:
            self.grad_buffer.zero_()
        elif self.releases_main_grads:
            self.release_main_grads()
        elif self.main_grads is not None:  # host-resident shard gradients (param_offload) are kept, zeroed
            self.main_grads.zero_()
        self.grad_state, self.outer_grad_state = GradState.EMPTY, OuterGradState.NONE  # zeroing: from any state
        self.optim_grads_written = False
        self._optimizer_grad_storage = None
        self.grad_marks.clear()
        for view in self.main_param_views:
            if view is not None:
                view.grad = None
                if getattr(view, "decoupled_grad", None) is not None:
                    view.decoupled_grad = None

    def _grads_for_optimizer(self) -> torch.Tensor:
        if self.optim_grads is self.main_grads:
            self.ensure_main_grads()
        return self.optim_grads

    def attach_optimizer_grads(self):
        """Point each main-weight view's `.grad` at its gradient (cast to the main dtype when they differ). A view
        an offloading optimizer moved to host memory cannot take a device tensor as `.grad`: it gets it as
        `decoupled_grad` (what Megatron's optimizers read first), which that optimizer copies to the host.
        Parameters no rank gave a gradient (`grad_marks.ungraded`, see ungraded_params.py) get none."""
        if self.main_weights is None:
            return
        grads = self._grads_for_optimizer()
        if grads.dtype != self.main_dtype:
            self._optimizer_grad_storage = grads.to(self.main_dtype)
            grads = self._optimizer_grad_storage
        for index, view in enumerate(self.main_param_views):
            if index in self.grad_marks.ungraded:  # no rank gave it a gradient: the step leaves it alone
                view.grad = None
                if getattr(view, "decoupled_grad", None) is not None:
                    view.decoupled_grad = None
                continue
            grad = self._main_view(grads, index)
            if view.device == grad.device:
                view.grad = grad
            else:
                view.grad, view.decoupled_grad = None, grad

    def scale_grads(self, factor: float):
        """Multiply every gradient this group holds, wherever the step has put it: the persistent or shard
        buffer (before `finish_grad_sync`), the HFSDP sub-shard and the main-dtype copy handed to the optimizer
        (after it). Call only with no reduction in flight: one landing later would add unscaled values."""
        target = self.grad_buffer if self.grad_buffer is not None else self.main_grads
        if target is not None and not self.main_grads_released:  # a released buffer is all zeros
            target.mul_(factor)
        if self.optim_grads is not None and self.optim_grads is not self.main_grads:
            self.optim_grads.mul_(factor)
        if self._optimizer_grad_storage is not None:
            self._optimizer_grad_storage.mul_(factor)

    def reduced_grad_views(self) -> List[torch.Tensor]:
        """Per parameter, this rank's piece of the reduced gradients the optimizer will step with (before any
        cast to the main dtype)."""
        if self.optim_grads is None:
            return []
        return [self._main_view(self._grads_for_optimizer(), index) for index in range(len(self.params))]

    def optimizer_grad_views(self) -> List[torch.Tensor]:
        if self.main_weights is None:
            return []
        grads = self._grads_for_optimizer()
        if self._optimizer_grad_storage is not None:
            grads = self._optimizer_grad_storage
        return [self._main_view(grads, index) for index in range(len(self.params))]

"""What `.grad` of the module's parameters shows: nothing until a step's gradients are synchronised, then this
rank's part of the reduced gradients, as a DTensor.

Gradients arrive in a post-accumulate-grad hook that moves them into the flat gradient buffers and leaves
`param.grad` None, so the reduction runs from one flat buffer. `.grad` is attached once every reduction of the
step, inner and outer, has landed: at the end of the backward of a synchronised microbatch (sync on:
`set_model_auto_sync(True)` / `sync_model_each_microbatch=True`, outside `no_sync()`), or in
`finish_grad_sync()` (which `optimizer.step()` runs). Microbatches run with sync off leave every `.grad` None,
under every strategy (strategies 2/3 reduce them anyway; the sums are not final). Each trainable parameter the
module shows then gets a DTensor `.grad` (under a torch optimizer, except those no rank gave a gradient since the
last clearing, which keep None as torch leaves them: ungraded_params.py):

| strategy               | parameter the module shows | `.grad` (a view of the gradients the optimizer steps with) |
|------------------------|----------------------------|-----------------------------------------------------------|
| 0 no_shard             | full tensor                | Replicate() DTensor: the all-reduced gradient              |
| 1 optim, 2 optim_grads | full tensor                | Shard(0) DTensor (full shape): this rank's rows of it      |
| 3 optim_grads_params   | Shard(0) DTensor (resting) | Shard(0) DTensor: this rank's rows of it                   |

on the data-parallel (shard) mesh; HSDP's gradients, summed over the outer ranks, are the same on every outer
rank. A 0-dim parameter's reduced gradient lands on shard rank 0, in its slot of the shard; the other ranks' slot
is padding, which the optimizer does not step. When `.grad` is attached, rank 0's value is broadcast into those
slots, and the gradient is a `Replicate()` DTensor over each rank's slot, so element-wise in-place changes that a
`Partial()` placement would refuse (`torch.nn.utils.clip_grad_value_`, `p.grad.clamp_`) work and reach rank 0's,
the one the step uses. As views, in-place changes (`torch.nn.utils.clip_grad_norm_`, scaling) reach the step.

HFSDP (`outer_dp_sharding_strategy='optim'`) reduces each rank's rows once more, in flat ranges, over the
outer ranks: the optimizer steps with this rank's sub-shard only. Its `.grad` is a DTensor on the
(outer, shard) mesh placed `(Partial(), Shard(0))`: the local tensor has this rank's rows' shape and holds the
reduced gradient where the rows fall in this rank's sub-shard, zeros elsewhere, so the sum over the outer ranks
is the gradient of the rows. That cannot be a view of the sub-shard (the rows of a sub-shard start and end
mid-row), so it is a copy, one shard-sized buffer per group, refreshed whenever `.grad` is attached (again in
`finish_grad_sync`): read it, but change the step's gradients with `scale_gradients` / `clip_grad_norm_`.

Gradients kept in another dtype than the parameters (fp32 gradients of a bf16 model, the default policy) are
shown as they are: the parameter's `grad_dtype` is set to theirs while attached and restored when dropped; a
torch without `grad_dtype` gets no `.grad` for such parameters. `optimizer.zero_grad()` (`zero_grad_buffer()`)
drops them, and so does the start of the next backward: autograd would otherwise accumulate the next
microbatch's gradient into the reduced one.
"""

from typing import Dict, List, Tuple

import torch
import torch.nn as nn

from torch.distributed.tensor import Partial, Replicate, Shard

from . import collectives
from .distributed_data_parallel_config import ShardingStrategy
from .dtensor_views import dtensor_over_view
from .resting_parameters import rows_dtensor


def _set_grad(param: nn.Parameter, grad: torch.Tensor) -> bool:
    """Attach `grad`, declaring its dtype as the parameter's `grad_dtype` when they differ; False if torch cannot."""
    if grad.dtype != param.dtype:
        if not hasattr(param, "grad_dtype"):
            return False
        param.grad_dtype = grad.dtype
    param.grad = grad
    return True


class ParamGrads:
    """Attaches the reduced gradients as `.grad` of the parameters the module shows, and drops them again."""

    def __init__(self, groups, strategy: ShardingStrategy, mesh_of, resting=None, outer_mesh_of=None):
        """`mesh_of(group)`: the mesh of the ranks the group is sharded over (the data-parallel mesh, or the
        expert data-parallel one for expert groups). `resting`: strategy 3's RestingParameters (the module shows
        those between steps). `outer_mesh_of(group)` (HFSDP): the group's state-dict mesh, outer dim first, shard
        dim last (a tp dim between them is replicated over: the gradients are of this rank's tensor-parallel
        partition)."""
        self._groups = list(groups)
        self._strategy = strategy
        self._mesh_of = mesh_of
        self._resting = resting
        self._outer_mesh_of = outer_mesh_of
        # id(group) -> [(parameter, its grad_dtype before)] for each group whose gradients are attached
        self._attached: Dict[int, List[Tuple[nn.Parameter, torch.dtype]]] = {}
        # (id(group), index) -> (the group's main_grads when built, the gradient viewing it): the views stay
        # valid while the buffer is released and given its storage back, so each is built once, not per step.
        self._grads: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = {}
        # HFSDP: id(group) -> the shard-sized buffer its `.grad` copies view, while attached
        self._outer_copies: Dict[int, torch.Tensor] = {}

    def _shown(self, group, index: int) -> nn.Parameter:
        param = group.params[index]
        return self._resting.resting_of(param) if self._resting is not None else param

    @staticmethod
    def _attachable(group) -> bool:
        if not group.trainable or group.main_grads is None:
            return False
        if group.outer_sharded:  # no gradient reached the group in this step: its sub-shard was never written
            return group.optim_grads_written
        return not group.main_grads_released

    def attach(self):
        """Point each parameter's `.grad` at its part of the reduced gradients. Every reduction of the step,
        inner and outer, must have landed (the end of a synchronised backward, or `finish_grad_sync`). Views
        attached since the last `drop` stay (the end of the backward attaches them, `finish_grad_sync` adds the
        groups that got no gradient); HFSDP's copies are refreshed."""
        for group in self._groups:
            if group.outer_sharded:
                self._drop_group(group)
            if id(group) in self._attached or not self._attachable(group):
                continue
            attached = self._attached[id(group)] = []
            for index in range(len(group.params)):
                param = self._shown(group, index)
                if index in group.grad_marks.ungraded:  # no rank gave it a gradient (ungraded_params.py)
                    continue
                if group.outer_sharded:
                    grad = self._outer_sharded_grad(group, index, param)
                else:
                    grad = self._grad_view(group, index, param)
                    if not param.dim() and self._strategy != ShardingStrategy.no_shard:
                        collectives.broadcast_small(grad.to_local(), self._mesh_of(group).get_group())
                previous_dtype = getattr(param, "grad_dtype", param.dtype)
                if _set_grad(param, grad):
                    attached.append((param, previous_dtype))

    def _grad_view(self, group, index: int, param: nn.Parameter) -> torch.Tensor:
        """Parameter `index`'s part of `group.main_grads`: a Replicate() DTensor of the whole gradient
        (no_shard), or of a 0-dim parameter's slot (its value once `attach` broadcast it), or a DTensor of this
        rank's rows."""
        source, grad = self._grads.get((id(group), index), (None, None))
        if source is not group.main_grads:
            if self._strategy == ShardingStrategy.no_shard:
                span = group.layout.spans[index]
                whole = group.main_grads[span.flat_start:span.flat_end].view(span.shape)
                grad = dtensor_over_view(whole, self._mesh_of(group), [Replicate()], param.shape, param.stride())
            elif not param.dim():
                slot = group.rows_of_shard(group.main_grads, index)
                grad = dtensor_over_view(slot, self._mesh_of(group), [Replicate()], param.shape, param.stride())
            else:
                grad = rows_dtensor(group.rows_of_shard(group.main_grads, index), param, self._mesh_of(group))
            self._grads[(id(group), index)] = (group.main_grads, grad)
        return grad

    def _outer_sharded_grad(self, group, index: int, param: nn.Parameter) -> torch.Tensor:
        """HFSDP: this rank's rows of the gradient, holding the reduced values of its sub-shard and zeros
        elsewhere, placed Partial() over the outer dim (a copy; see the module docstring)."""
        copy = self._outer_copies.get(id(group))
        if copy is None:
            copy = torch.zeros(group.layout.shard_numel, dtype=group.optim_grads.dtype, device=group.device)
            copy[group.sub_shard_slice].copy_(group.optim_grads)
            self._outer_copies[id(group)] = copy
        local = group.rows_of_shard(copy, index)
        mesh = self._outer_mesh_of(group)
        placements = [Partial()] + [Replicate()] * (mesh.ndim - 2) + [Shard(0) if param.dim() else Partial()]
        return dtensor_over_view(local, mesh, placements, param.shape, param.stride())

    def drop(self):
        """Detach every gradient attached by `attach` and restore the parameters' `grad_dtype`."""
        for group in self._groups:
            self._drop_group(group)

    def _drop_group(self, group):
        for param, previous_dtype in self._attached.pop(id(group), ()):
            param.grad = None
            if getattr(param, "grad_dtype", previous_dtype) != previous_dtype:
                param.grad_dtype = previous_dtype
        self._outer_copies.pop(id(group), None)

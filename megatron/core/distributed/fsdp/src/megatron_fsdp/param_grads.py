"""What `.grad` of the module's parameters shows once a step's gradients are reduced: this rank's part of them.

Gradients arrive in a post-accumulate-grad hook that moves them into the flat gradient buffers and leaves
`param.grad` None, so the reduction runs from one flat buffer. Once the reductions of a step have landed (at
the end of the backward of a synchronised microbatch, or in `finish_grad_sync()` when they were deferred:
`no_sync`, `sync_model_each_microbatch=False`, HSDP's outer all-reduce), each trainable parameter the module
shows gets a `.grad` that VIEWS the reduced gradient the optimizer steps with, so in-place changes
(`torch.nn.utils.clip_grad_norm_`, scaling) reach the step:

| strategy               | parameter the module shows | `.grad`                                               |
|------------------------|----------------------------|-------------------------------------------------------|
| 0 no_shard             | full tensor                | full tensor: the all-reduced gradient                 |
| 1 optim, 2 optim_grads | full tensor                | Shard(0) DTensor (full shape): this rank's rows of it |
| 3 optim_grads_params   | Shard(0) DTensor (resting) | Shard(0) DTensor: this rank's rows of it              |

(a 0-dim parameter's DTensor gradient is `Partial()`, like its resting parameter.)
`optimizer.zero_grad()` (`zero_grad_buffer()`) sets them back to None, and so does the start of the next
backward: autograd would otherwise accumulate the next microbatch's gradient into the reduced one.

Where it is not attached, and why:
- HFSDP (`outer_dp_sharding_strategy='optim'`): the reduced gradient of a rank's rows is split once more, in
  flat ranges, over the outer ranks; no DTensor over the data-parallel mesh describes that, and a full-rows
  copy would need an all-gather over the outer group whose result the optimizer would not step with.
- Gradients kept in another dtype than the parameters (fp32 gradients of a bf16 model, the default policy):
  torch requires `.grad` to have the parameter's `grad_dtype`. That attribute is set to the gradients' dtype
  while the gradient is attached (and restored when it is dropped), so the fp32 gradient is shown as it is,
  without a copy; a torch without `grad_dtype` gets no `.grad` for such parameters.
"""

from typing import Dict, List, Tuple

import torch
import torch.nn as nn

from .distributed_data_parallel_config import ShardingStrategy
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

    def __init__(self, groups, strategy: ShardingStrategy, mesh, resting=None, outer_replicas: bool = False):
        """`resting`: strategy 3's RestingParameters (the module shows those between steps). `outer_replicas`
        (HSDP): the gradients are complete only after `finish_grad_sync` all-reduced them over the outer ranks."""
        self._groups = list(groups)
        self._strategy = strategy
        self._mesh = mesh
        self._resting = resting
        self._outer_replicas = outer_replicas
        self._attached: List[Tuple[nn.Parameter, torch.dtype]] = []  # (parameter, its grad_dtype before)
        # (id(group), index) -> (the group's main_grads when built, the gradient viewing it): the views stay
        # valid while the buffer is released and given its storage back, so each is built once, not per step.
        self._grads: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = {}

    def _shown(self, group, index: int) -> nn.Parameter:
        param = group.params[index]
        return self._resting.resting_of(param) if self._resting is not None else param

    @staticmethod
    def _attachable(group) -> bool:
        return group.trainable and group.main_grads is not None and not group.outer_sharded and (
            not group.main_grads_released)

    def attach(self, grad_sync_finished: bool):
        """Point each parameter's `.grad` at its part of the reduced gradients (every reduction of the step must
        have landed: at the end of a synchronised backward, or in `finish_grad_sync`)."""
        if self._outer_replicas and not grad_sync_finished:
            return
        self.drop()
        for group in self._groups:
            if not self._attachable(group):
                continue
            for index in range(len(group.params)):
                param = self._shown(group, index)
                grad = self._grad_view(group, index, param)
                previous_dtype = getattr(param, "grad_dtype", param.dtype)
                if _set_grad(param, grad):
                    self._attached.append((param, previous_dtype))

    def _grad_view(self, group, index: int, param: nn.Parameter) -> torch.Tensor:
        """Parameter `index`'s part of `group.main_grads`: a view (no_shard) or a DTensor of this rank's rows."""
        source, grad = self._grads.get((id(group), index), (None, None))
        if source is not group.main_grads:
            if self._strategy == ShardingStrategy.no_shard:
                span = group.layout.spans[index]
                grad = group.main_grads[span.flat_start:span.flat_end].view(span.shape)
            else:
                grad = rows_dtensor(group.rows_of_shard(group.main_grads, index), param, self._mesh)
            self._grads[(id(group), index)] = (group.main_grads, grad)
        return grad

    def drop(self):
        """Detach every gradient attached by `attach` and restore the parameters' `grad_dtype`."""
        for param, previous_dtype in self._attached:
            param.grad = None
            if getattr(param, "grad_dtype", previous_dtype) != previous_dtype:
                param.grad_dtype = previous_dtype
        self._attached = []

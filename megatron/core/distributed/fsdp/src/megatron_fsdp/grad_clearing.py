"""When the gradient buffers of a model stepped by several optimizers are cleared.

The optimizers built over one model (one AdamW over the blocks and one SGD over the embedding, say) share the
model's flat gradient buffers: one buffer holds the gradients of parameters of both. torch clears only an
optimizer's own parameters in its `zero_grad()`, so a loop may step and clear them one after the other
(`opt_a.step(); opt_a.zero_grad(); opt_b.step(); opt_b.zero_grad()`). The buffers are therefore cleared once the
`zero_grad()` calls made since they were last cleared cover the parameters of every optimizer over the model;
until then the other optimizers still step on this step's gradients. A backward that starts while only some of
them have cleared theirs (one optimizer accumulating over more backward passes than another) is refused, since
the buffers cannot keep one optimizer's gradients and drop another's.
"""

import gc
import weakref
from typing import List

import torch


class GradClearing:
    """Tracks the `zero_grad()` calls of the optimizers over one model since its gradient buffers were cleared."""

    def __init__(self):
        self._optimizers: List[weakref.ref] = []
        self._cleared = set()  # ids of the tensors the optimizers that called zero_grad() step

    def register(self, optimizer: torch.optim.Optimizer):
        self._optimizers.append(weakref.ref(optimizer))

    def optimizers(self) -> List[torch.optim.Optimizer]:
        """The registered optimizers still alive (one dropped by the caller no longer holds back the clearing)."""
        self._optimizers = [ref for ref in self._optimizers if ref() is not None]
        return [ref() for ref in self._optimizers]

    def _uncleared(self) -> List[torch.optim.Optimizer]:
        return [optimizer for optimizer in self.optimizers()
                if any(id(p) not in self._cleared for group in optimizer.param_groups for p in group["params"])]

    def request(self, optimizer: torch.optim.Optimizer) -> bool:
        """Record `optimizer.zero_grad()`; True when every optimizer has now cleared and the buffers are due."""
        self._cleared.update(id(p) for group in optimizer.param_groups for p in group["params"])
        if self._uncleared():
            return False
        self._cleared.clear()
        return True

    def reset(self):
        """The buffers were cleared (model.zero_grad(), zero_grad_buffer())."""
        self._cleared.clear()

    def check_before_backward(self) -> bool:
        """At the start of a backward: True when the buffers are due now (an optimizer that held them back was
        dropped since); raises when some optimizers cleared their gradients and others did not."""
        if not self._cleared:
            return False
        if self._uncleared():
            gc.collect()  # a dropped optimizer kept alive by a reference cycle (held by no list here then)
        uncleared = self._uncleared()
        if not uncleared:
            self._cleared.clear()
            return True
        cleared = [optimizer for optimizer in self.optimizers() if optimizer not in uncleared]
        raise RuntimeError(
            f"a backward started after zero_grad() of {_describe(cleared)} but not of {_describe(uncleared)}: the "
            "optimizers over one Megatron-FSDP model share its gradient buffers, which are cleared once every one "
            "of them has called zero_grad(). Call zero_grad() on each optimizer (or model.zero_grad()) before the "
            "next backward; accumulating one optimizer's gradients over more backward passes than another's "
            "needs a model (fully_shard_model) of its own for those parameters")


def _describe(optimizers) -> str:
    parts = []
    for optimizer in optimizers:
        names = list(getattr(optimizer, "_megatron_fsdp_param_names", {}).values())
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        parts.append(f"{type(optimizer).__name__}({shown})")
    return " and ".join(parts)

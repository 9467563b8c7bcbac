"""What a parameter group's gradients hold during a step, as two small state machines with checked transitions.

`GradState` follows the group's own gradients through the data-parallel (inner) reduction; `OuterGradState`
follows the reduced gradients through the reduction over the outer replicas (HSDP / HFSDP). A transition that
is not listed below is a bug in the schedule (a reduction of nothing, gradients added to a buffer whose outer
reduction was never reopened, ...): it raises at once instead of producing silently wrong gradients.
"""

import enum


class GradState(enum.Enum):
    """The group's gradients since the last `zero_grad`."""

    EMPTY = "empty"  # nothing written since the buffers were zeroed (or released)
    ACCUMULATING = "accumulating"  # local gradients written that no reduction has taken yet
    REDUCED = "reduced"  # every written gradient went into a reduction (in flight or landed)


class OuterGradState(enum.Enum):
    """The group's inner-reduced gradients with respect to the outer replicas (only used with an outer dim)."""

    NONE = "none"  # no inner-reduced data waiting for, or summed by, an outer reduction
    DUE = "due"  # inner-reduced data no outer reduction has taken yet
    # An outer reduction was issued. HSDP: the main gradients (will) hold the sum over the outer replicas, so more
    # gradients may only be added after reopening them (back to NONE). HFSDP: the sub-shard gradients were written.
    REDUCED = "reduced"


_GRAD_TRANSITIONS = {
    GradState.EMPTY: {GradState.ACCUMULATING},
    GradState.ACCUMULATING: {GradState.ACCUMULATING, GradState.REDUCED},
    # another microbatch: strategies 0/1 reopen their persistent buffer, strategies 2/3 start a transient one
    GradState.REDUCED: {GradState.ACCUMULATING},
}

_OUTER_TRANSITIONS = {
    OuterGradState.NONE: {OuterGradState.DUE},
    # DUE -> DUE: microbatches reduced under no_sync (strategies 2/3) add to main gradients before the outer one
    OuterGradState.DUE: {OuterGradState.DUE, OuterGradState.REDUCED},
    OuterGradState.REDUCED: {OuterGradState.NONE},
}


class GradStateError(RuntimeError):
    """A parameter group's gradients were asked to move to a state that does not follow from their current one."""


def checked_transition(current: enum.Enum, new: enum.Enum, group_name: str) -> enum.Enum:
    """`new` if the move from `current` is listed above; raises otherwise. (Zeroing the gradients returns both
    machines to EMPTY / NONE from anywhere and does not go through here.)"""
    table = _GRAD_TRANSITIONS if isinstance(current, GradState) else _OUTER_TRANSITIONS
    if type(new) is not type(current) or new not in table[current]:
        raise GradStateError(f"parameter group starting at '{group_name}': its gradients cannot go from "
                             f"{type(current).__name__}.{current.name} to {type(new).__name__}.{new.name}")
    return new

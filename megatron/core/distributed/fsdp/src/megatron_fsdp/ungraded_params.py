"""Parameters no data-parallel rank gave a gradient in a step: left without `.grad`, as torch leaves them.

A torch optimizer steps only the tensors whose `.grad` is set: a parameter the forward did not use (an unused
head, a branch skipped this step, an expert no token reached on any rank) keeps its value and its optimizer
state, untouched by AdamW's weight decay and momentum. Megatron-FSDP reduces a group's gradients as one flat
buffer, where such a parameter's reduced gradient is zeros. Under a torch optimizer (`fully_shard_optimizer`),
the parameters that received a gradient on no rank since the gradients were last cleared get no `.grad`: neither
their main-weight views (so the step leaves them and their state alone) nor the parameters the module shows.

Each rank marks the parameters whose gradient arrived in its backwards (`GradMarks`); once the step's reductions
have landed, one all-reduce (max) of the marks per sharding process group, and one more over the outer group
under HSDP, makes every rank agree. It runs once per step, after the step's last backward, on every rank alike.
Megatron's own optimizers (pretrain_gpt.py) step every parameter, as upstream's do: there nothing is left out.
"""

from typing import Callable, Dict, List, Tuple

import torch

from . import collectives


class GradMarks:
    """Which parameters of one group received a gradient on this rank since the gradients were last cleared, and
    (after `agree_on_ungraded_params`) which received one on no rank."""

    def __init__(self, num_params: int):
        self.arrived = [False] * num_params
        self.ungraded = frozenset()

    def mark(self, indices):
        for index in indices:
            self.arrived[index] = True

    def clear(self):
        self.arrived = [False] * len(self.arrived)
        self.ungraded = frozenset()


def agree_on_ungraded_params(groups, shard_group_of: Callable, outer_group_of: Callable):
    """Collective over every group's sharding and outer process groups (call it on every rank, with the same
    groups): each trainable group's `grad_marks.ungraded` becomes the indices of the parameters that received a
    gradient on none of the ranks."""
    by_process_groups: Dict[Tuple[int, int], Tuple[object, object, List]] = {}
    for group in groups:
        if group.trainable and group.main_weights is not None:
            shard_group, outer_group = shard_group_of(group), outer_group_of(group)
            key = (id(shard_group), id(outer_group))
            by_process_groups.setdefault(key, (shard_group, outer_group, []))[2].append(group)
    for shard_group, outer_group, members in by_process_groups.values():
        marks = torch.tensor([arrived for group in members for arrived in group.grad_marks.arrived],
                             dtype=torch.int32, device=members[0].device)
        collectives.all_reduce_max(marks, shard_group)
        if outer_group is not None:
            collectives.all_reduce_max(marks, outer_group)
        flags, start = marks.tolist(), 0
        for group in members:
            count = len(group.grad_marks.arrived)
            group.grad_marks.ungraded = frozenset(index for index, arrived in enumerate(flags[start:start + count])
                                                  if not arrived)
            start += count

"""Which parameters form which communication group: one group per FSDP unit (split by dtype, requires_grad,
whether a gather codec encodes them, see gather_codec.py, and whether they are Mixture-of-Experts expert
parameters, sharded over the expert data-parallel ranks instead), and size-capped buckets for everything
outside the units."""

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch.nn as nn

from .layout import bucket_by_size
from .utils import outermost_unit_modules, parameter_owners

DEFAULT_BUCKET_NUMEL = 40_000_000


@dataclass
class GroupPlan:
    unit_index: Optional[int]  # None: outside any unit (under strategy 3 gathered from forward until its grads)
    params: List[nn.Parameter] = field(default_factory=list)
    names: List[str] = field(default_factory=list)
    encoded: bool = False  # its parameters travel through the all-gather encoded (gather_codec.py)
    expert: bool = False  # expert parameters: sharded and reduced over the expert data-parallel ranks


def _split_by_kind(entries: List[Tuple[str, nn.Parameter]], encodes: Callable[[nn.Parameter], bool],
                   is_expert: Callable[[nn.Parameter], bool]
                   ) -> List[Tuple[bool, bool, List[Tuple[str, nn.Parameter]]]]:
    """(encoded, expert, entries) per (dtype, requires_grad, encoded, expert) kind, keeping first-appearance
    order of kinds and of parameters within a kind."""
    kinds: Dict[tuple, List[Tuple[str, nn.Parameter]]] = {}
    for name, param in entries:
        key = (param.dtype, param.requires_grad, encodes(param), bool(is_expert(param)))
        kinds.setdefault(key, []).append((name, param))
    return [(key[2], key[3], kind) for key, kind in kinds.items()]


def plan_groups(module: nn.Module, unit_classes: tuple, bucket_numel: Optional[int], disable_bucketing: bool,
                root_buckets_unit_sized: bool = False, encodes: Optional[Callable[[nn.Parameter], bool]] = None,
                is_expert: Optional[Callable[[nn.Parameter], bool]] = None):
    """Returns (unit modules, group plans). A parameter shared between a unit and anything outside it
    (a tied embedding/output weight, say) goes to the root groups; under strategy 3 those are gathered from
    the forward until their gradients are in. `is_expert(param)` picks the parameters that go to groups of their
    own (expert parameters, sharded over another group of ranks); None: no parameter does.

    With `root_buckets_unit_sized` (strategy 3) and no explicit `bucket_numel`, root buckets are capped at the
    largest unit's size rather than the default, so an output layer and an input embedding land in different
    groups: each is reduced and released as soon as its own gradients are in, instead of both staying
    gathered, with a transient gradient buffer for both, through the whole backward."""
    units = outermost_unit_modules(module, unit_classes)
    owners = parameter_owners(module)
    module_to_unit = {}
    for unit_index, unit in enumerate(units):
        for inner in unit.modules():
            module_to_unit[id(inner)] = unit_index

    per_unit: List[List[Tuple[str, nn.Parameter]]] = [[] for _ in units]
    root: List[Tuple[str, nn.Parameter]] = []
    for name, param in module.named_parameters():
        unit_ids = {module_to_unit.get(id(owner)) for owner, _ in owners[id(param)]}
        if len(unit_ids) == 1 and None not in unit_ids:
            per_unit[unit_ids.pop()].append((name, param))
        else:
            root.append((name, param))

    encodes = encodes or (lambda param: False)
    is_expert = is_expert or (lambda param: False)
    plans: List[GroupPlan] = []
    for unit_index, entries in enumerate(per_unit):
        for encoded, expert, kind in _split_by_kind(entries, encodes, is_expert):
            plans.append(GroupPlan(unit_index, [p for _, p in kind], [n for n, _ in kind], encoded, expert))
    cap = 0 if disable_bucketing else (DEFAULT_BUCKET_NUMEL if bucket_numel is None else bucket_numel)
    if root_buckets_unit_sized and bucket_numel is None and not disable_bucketing and units:
        largest_unit = max(sum(p.numel() for _, p in entries) for entries in per_unit)
        cap = min(cap, max(largest_unit, 1))
    for encoded, expert, kind in _split_by_kind(root, encodes, is_expert):
        for bucket in bucket_by_size([p.numel() for _, p in kind], cap):
            plans.append(GroupPlan(None, [kind[i][1] for i in bucket], [kind[i][0] for i in bucket], encoded,
                                   expert))
    return units, plans

"""Mixture-of-Experts expert parameters as the data-parallel wrappers, the optimizers and the checkpoints see them.

An expert parameter is one built with `is_expert=True` (`ColumnParallelLinear` / `RowParallelLinear`), which
marks it `allreduce = False`: each expert-parallel rank holds different experts, so its gradient is reduced over
the *expert* data-parallel group (the ranks holding the same experts), not over DP x CP. The expert layers also
mark every expert parameter with `expert_global_index` (the expert's index over all expert-parallel ranks) and
`num_local_experts`.

Statistics over the whole model (gradient norm, zero count) count each expert once: a rank's sum over its expert
gradients is reduced over the expert tensor x expert x pipeline parallel group (the other slices and experts),
plus the expert data-parallel group where the gradients are sharded over it.
"""

import re

import torch
import torch.distributed as dist

from megatron.core.device_utils import get_device_for_group

_LOCAL_EXPERT = re.compile(r"(^|\.)local_experts\.(\d+)\.")


def is_expert_parameter(param) -> bool:
    """Whether `param` belongs to one expert of a MoE layer (its gradient is reduced over expert data parallel)."""
    return getattr(param, "allreduce", True) is False


def split_expert_parameters(params):
    """`(dense, expert)`: `params` in their order, split by `is_expert_parameter`."""
    dense, expert = [], []
    for param in params:
        (expert if is_expert_parameter(param) else dense).append(param)
    return dense, expert


def global_expert_name(name: str, param) -> str:
    """`...local_experts.{j}...` renamed to `...local_experts.{expert_global_index}...`: the name an expert
    tensor has in a checkpoint whatever the expert-parallel size that saved or loads it. Other names (and
    expert parameters without `expert_global_index`) are returned unchanged."""
    index = getattr(param, "expert_global_index", None)
    if index is None or not is_expert_parameter(param):
        return name
    return _LOCAL_EXPERT.sub(lambda match: f"{match.group(1)}local_experts.{int(index)}.", name, count=1)


def _parallel_state_if_initialized():
    from megatron.core import parallel_state

    return parallel_state if parallel_state.model_parallel_is_initialized() else None


def expert_data_parallel_group():
    """The ranks holding the same experts (the whole world without parallel state)."""
    parallel_state = _parallel_state_if_initialized()
    if parallel_state is None:
        return dist.group.WORLD
    return parallel_state.get_expert_data_parallel_group()


def expert_grad_stats_groups(shard_group=None):
    """Groups over which a rank's sum over its expert gradients is reduced so every expert counts once: expert
    tensor x expert x pipeline parallel (ETP x EP x PP), and `shard_group` when the gradients are sharded over
    it."""
    parallel_state = _parallel_state_if_initialized()
    groups = []
    if parallel_state is not None:
        groups.append(parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    if shard_group is not None:
        groups.append(shard_group)
    return groups


def model_has_expert_parameters(model_chunks) -> bool:
    """Whether any rank's chunks hold expert parameters (collective over the world when it is initialised): a
    pipeline stage without MoE layers must still take part in the expert statistics' reductions."""
    local = any(is_expert_parameter(param) for chunk in model_chunks for param in chunk.parameters())
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    flag = torch.tensor([1.0 if local else 0.0], device=get_device_for_group(dist.group.WORLD))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)

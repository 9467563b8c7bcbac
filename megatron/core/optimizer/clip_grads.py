"""Global norms (of gradients, or of the parameters themselves), clipping and zero counting across tensor-,
pipeline- and data-parallel ranks.

Every parameter must be counted exactly once over the whole model:
- tensor-parallel partitions (`tensor_model_parallel=True`) are disjoint pieces: every TP rank counts its own;
- parameters duplicated across TP ranks (norms, row-parallel biases) are counted on TP rank 0 only;
- embedding weights shared by the first and last pipeline stage (`shared_embedding=True`) are counted on the
  first stage only.
The per-rank sums are then all-reduced over `grad_stats_groups`: the model-parallel group, plus the
data-parallel group when the gradients are data-parallel shards (distributed optimizer).
"""

import math

import torch
import torch.distributed as dist


def _parallel_state_if_initialized():
    try:
        from megatron.core import parallel_state
    except ImportError:
        return None
    return parallel_state if parallel_state.model_parallel_is_initialized() else None


def param_is_not_tensor_parallel_duplicate(param):
    """True for TP partitions everywhere and for TP-duplicated parameters on TP rank 0 (for an expert's
    parameter: expert tensor-parallel rank 0, the ranks it is duplicated over being the expert TP group)."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    parallel_state = _parallel_state_if_initialized()
    if parallel_state is None:
        return True
    if getattr(param, "allreduce", True) is False:
        return parallel_state.get_expert_tensor_parallel_rank() == 0
    return parallel_state.get_tensor_model_parallel_rank() == 0


def param_is_not_shared(param):
    """False for the copy of a shared embedding that lives on a pipeline stage other than the first."""
    if not getattr(param, "shared_embedding", False):
        return True
    parallel_state = _parallel_state_if_initialized()
    return parallel_state is None or parallel_state.is_pipeline_first_stage()


def param_counts_for_grad_stats(param):
    return param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param)


def default_grad_stats_groups():
    """The model-parallel group (TP x PP) when parallel state is initialised, else no group at all."""
    parallel_state = _parallel_state_if_initialized()
    return [] if parallel_state is None else [parallel_state.get_model_parallel_group()]


def _as_group_list(groups):
    if groups is None:
        return []
    if isinstance(groups, (list, tuple)):
        return [group for group in groups if group is not None]
    return [groups]


def _all_reduce_over(tensor, groups, op):
    for group in _as_group_list(groups):
        if dist.get_world_size(group) > 1:
            dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _pieces_by_shard_groups(grads):
    """{shard groups: local tensors}. A DTensor gradient (FSDP2) contributes its local shard, keyed by the
    groups of the mesh dims it is sharded over, where the other pieces of it live; a plain tensor is keyed ()."""
    pieces = {}
    for grad in grads:
        if hasattr(grad, "to_local") and hasattr(grad, "placements"):
            mesh = grad.device_mesh
            groups = tuple(mesh.get_group(dim) for dim, placement in enumerate(grad.placements) if placement.is_shard())
            grad = grad.to_local()
        else:
            groups = ()
        pieces.setdefault(groups, []).append(grad)
    return pieces


def _reduce_pieces(pieces, local_value, op, device):
    """`local_value(tensors)` (a float32 scalar tensor) per key of `pieces`, reduced over the key's groups with
    `op`, then combined (SUM / MAX) into one 1-element tensor on `device`."""
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for groups, tensors in pieces.items():
        value = local_value(tensors).reshape(1).to(device=device, dtype=torch.float32)
        _all_reduce_over(value, list(groups), op)
        total = torch.maximum(total, value) if op == dist.ReduceOp.MAX else total + value
    return total


def global_norm_fp32(tensors, norm_type=2.0, grad_stats_groups=None, device=None):
    """The global norm of already de-duplicated tensors (gradients, or parameters for the parameter norm), as a
    Python float (`inf` norm supported). The per-rank results are reduced over `grad_stats_groups`.

    DTensors count their local shards, summed over the mesh dims they are sharded on."""
    grads = [tensor for tensor in tensors if tensor is not None]
    norm_type = float(norm_type)
    if device is None:
        device = grads[0].device if grads else torch.device("cpu")
    pieces = _pieces_by_shard_groups(grads)
    pieces = {groups: [t for t in tensors if t.numel() > 0] for groups, tensors in pieces.items()}
    if norm_type == math.inf:

        def local_max(tensors):
            return max((t.detach().abs().max().float() for t in tensors), default=torch.tensor(0.0))

        total = _reduce_pieces(pieces, local_max, dist.ReduceOp.MAX, device)
        _all_reduce_over(total, grad_stats_groups, dist.ReduceOp.MAX)
        return total.item()

    total = _reduce_pieces(pieces, lambda tensors: _local_power_sum(tensors, norm_type, device), dist.ReduceOp.SUM,
                           device)
    _all_reduce_over(total, grad_stats_groups, dist.ReduceOp.SUM)
    return total.item() ** (1.0 / norm_type)


def _local_power_sum(tensors, norm_type, device):
    """Sum over `tensors` of |x|^norm_type, a float32 scalar on `device`."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm([t.detach().float() for t in tensors], norm_type)
    return torch.stack(norms).pow(norm_type).sum()


def _reduction_ranks(groups):
    """The ranks of each group in `groups` that reduces anything (more than one rank), in order."""
    return [tuple(dist.get_process_group_ranks(group)) for group in _as_group_list(groups)
            if dist.get_world_size(group) > 1]


def global_norms_fp32(parts, norm_type=2.0, device=None):
    """`[global_norm_fp32(tensors, norm_type, groups, device) for tensors, groups in parts]` (the dense and the
    expert gradients, say), with one all-reduce of all the parts' sums where that adds up the same numbers:
    finite `norm_type`, plain tensors (no DTensor shards of their own groups) and every part reduced over the same
    ranks. Otherwise each part on its own."""
    parts = [([tensor for tensor in tensors if tensor is not None], groups) for tensors, groups in parts]
    ranks = [_reduction_ranks(groups) for _, groups in parts] if dist.is_initialized() else [[]]
    fusable = (len(parts) > 1 and float(norm_type) != math.inf and all(r == ranks[0] for r in ranks)
               and not any(hasattr(tensor, "to_local") for tensors, _ in parts for tensor in tensors))
    if not fusable:
        return [global_norm_fp32(tensors, norm_type, groups, device) for tensors, groups in parts]
    norm_type = float(norm_type)
    if device is None:
        device = next((tensors[0].device for tensors, _ in parts if tensors), torch.device("cpu"))
    sums = torch.stack([_local_power_sum([t for t in tensors if t.numel() > 0], norm_type, device)
                        for tensors, _ in parts])
    _all_reduce_over(sums, parts[0][1], dist.ReduceOp.SUM)
    return [value ** (1.0 / norm_type) for value in sums.tolist()]


def get_grad_norm_fp32(grads_for_norm, norm_type=2.0, grad_stats_groups=None, device=None):
    """The global norm of already de-duplicated gradients (upstream's name; see `global_norm_fp32`)."""
    return global_norm_fp32(grads_for_norm, norm_type, grad_stats_groups, device)


def clip_grad_by_total_norm_fp32(grads, max_norm, total_norm):
    """Scale `grads` in place so that their global norm `total_norm` becomes at most `max_norm`."""
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    # Scaling by a number commutes with every placement (shards, replicas, pending sums): a DTensor is scaled
    # through its local tensor, without DTensor's dispatch.
    grads = [grad.to_local() if hasattr(grad, "to_local") else grad for grad in grads if grad is not None]
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def count_zeros_fp32(grads_for_count, grad_stats_groups=None, device=None):
    """Number of exactly-zero entries over de-duplicated gradients, summed over `grad_stats_groups` (DTensor
    gradients: their local shards, summed over the mesh dims they are sharded on)."""
    grads = [grad for grad in grads_for_count if grad is not None]
    if device is None:
        device = grads[0].device if grads else torch.device("cpu")

    def local_zeros(tensors):
        count = torch.zeros((), dtype=torch.float32, device=device)
        for tensor in tensors:
            count += tensor.numel() - torch.count_nonzero(tensor)
        return count

    total = _reduce_pieces(_pieces_by_shard_groups(grads), local_zeros, dist.ReduceOp.SUM, device)
    _all_reduce_over(total, grad_stats_groups, dist.ReduceOp.SUM)
    return total.item()


def tensors_counted_once(params, tensor_of):
    """`tensor_of(param)` for the `params` that count towards a global statistic (see the module docstring):
    each element of the model appears once over all ranks after the reduction over `grad_stats_groups`."""
    return [tensor_of(param) for param in params
            if param_counts_for_grad_stats(param) and tensor_of(param) is not None]


def grads_for_grad_stats(params, grad_of=None):
    """The gradients of `params` that count towards the global gradient norm (see the module docstring)."""
    return tensors_counted_once(params, grad_of or (lambda param: param.grad))

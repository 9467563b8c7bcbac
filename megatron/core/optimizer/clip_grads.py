"""Global gradient norm, clipping and zero counting across tensor-, pipeline- and data-parallel ranks.

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
    """True for TP partitions everywhere and for TP-duplicated parameters on TP rank 0."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    parallel_state = _parallel_state_if_initialized()
    return parallel_state is None or parallel_state.get_tensor_model_parallel_rank() == 0


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


def get_grad_norm_fp32(grads_for_norm, norm_type=2.0, grad_stats_groups=None, device=None):
    """The global norm of already de-duplicated gradients, as a Python float (`inf` norm supported)."""
    grads = [grad for grad in grads_for_norm if grad is not None and grad.numel() > 0]
    norm_type = float(norm_type)
    if device is None:
        device = grads[0].device if grads else torch.device("cpu")
    if norm_type == math.inf:
        local = max((grad.detach().abs().max().float() for grad in grads), default=torch.tensor(0.0))
        total = torch.tensor([float(local)], dtype=torch.float32, device=device)
        _all_reduce_over(total, grad_stats_groups, dist.ReduceOp.MAX)
        return total.item()
    total = torch.zeros(1, dtype=torch.float32, device=device)
    if grads:
        norms = torch._foreach_norm([grad.detach().float() for grad in grads], norm_type)
        total += torch.stack(norms).pow(norm_type).sum()
    _all_reduce_over(total, grad_stats_groups, dist.ReduceOp.SUM)
    return total.item() ** (1.0 / norm_type)


def clip_grad_by_total_norm_fp32(grads, max_norm, total_norm):
    """Scale `grads` in place so that their global norm `total_norm` becomes at most `max_norm`."""
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    grads = [grad for grad in grads if grad is not None]
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def count_zeros_fp32(grads_for_count, grad_stats_groups=None, device=None):
    """Number of exactly-zero entries over de-duplicated gradients, summed over `grad_stats_groups`."""
    grads = [grad for grad in grads_for_count if grad is not None]
    if device is None:
        device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for grad in grads:
        total += grad.numel() - torch.count_nonzero(grad)
    _all_reduce_over(total, grad_stats_groups, dist.ReduceOp.SUM)
    return total.item()


def grads_for_grad_stats(params, grad_of=None):
    """The gradients of `params` that count towards the global norm (see the module docstring)."""
    grad_of = grad_of or (lambda param: param.grad)
    return [grad_of(param) for param in params if param_counts_for_grad_stats(param) and grad_of(param) is not None]

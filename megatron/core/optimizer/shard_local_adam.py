"""AdamW that updates DTensor parameters through their local shards.

AdamW is elementwise: where a DTensor parameter and its gradient have the same placements and the gradient holds
no pending (`Partial`) sum, updating each rank's local shard is the update of the whole tensor. Handing the local
tensors to torch's AdamW kernels skips DTensor's dispatch and its sharding propagation for every foreach op (the
propagation is computed afresh for each new device mesh, so a run's first step paid for it in full). Optimizer
state stays a DTensor of the parameter's placements (zeros_like of the parameter), so state dicts and
distributed checkpoints are unchanged. Any other parameter (a plain tensor, or a DTensor whose gradient differs
in placement) is stepped as torch's AdamW steps it.
"""

import torch
from torch.optim.adam import adam

from megatron.core.distributed.data_parallel_base import is_dtensor


def steps_on_local_shard(param):
    """Whether `param`'s update equals the update of its local shard (see the module docstring)."""
    grad = param.grad
    if not (is_dtensor(param) and is_dtensor(grad)):
        return False
    from torch.distributed.tensor.placement_types import Partial

    return (tuple(grad.placements) == tuple(param.placements) and grad.device_mesh == param.device_mesh
            and not any(isinstance(placement, Partial) for placement in grad.placements))


def _scalar_dtype(fused):
    if fused:
        return torch.float32
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class ShardLocalAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` with the same arguments, state and results; DTensor parameters update locally.
    `differentiable=True` (a step autograd can differentiate through) is torch's AdamW's alone."""

    def __init__(self, params, *args, **kwargs):
        if kwargs.get("differentiable"):
            raise ValueError("ShardLocalAdamW steps under no_grad: use torch.optim.AdamW for differentiable=True")
        super().__init__(params, *args, **kwargs)

    def _state_of(self, param, group):
        state = self.state[param]
        if not state:
            on_device = group["capturable"] or group["fused"]
            state["step"] = torch.zeros((), dtype=_scalar_dtype(group["fused"]),
                                        device=param.device if on_device else "cpu")
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def _update(self, group, params, local):
        """One functional AdamW call over `params` (all local-shard ones, or none of them)."""
        if not params:
            return
        view = (lambda tensor: tensor.to_local()) if local else (lambda tensor: tensor)
        states = [self._state_of(param, group) for param in params]
        for param in params:
            if param.grad.is_sparse:
                raise RuntimeError(f"AdamW does not support sparse gradients (parameter of shape "
                                   f"{tuple(param.shape)}); use torch.optim.SparseAdam for it")
        adam([view(param) for param in params], [view(param.grad) for param in params],
             [view(state["exp_avg"]) for state in states], [view(state["exp_avg_sq"]) for state in states],
             [view(state["max_exp_avg_sq"]) for state in states] if group["amsgrad"] else [],
             [state["step"] for state in states],
             foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
             fused=group["fused"], grad_scale=getattr(self, "grad_scale", None),
             found_inf=getattr(self, "found_inf", None),
             has_complex=any(torch.is_complex(param) for param in params), decoupled_weight_decay=True,
             amsgrad=group["amsgrad"], beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"],
             weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            with_grad = [param for param in group["params"] if param.grad is not None]
            local = [param for param in with_grad if steps_on_local_shard(param)]
            local_ids = {id(param) for param in local}
            self._update(group, local, local=True)
            self._update(group, [param for param in with_grad if id(param) not in local_ids], local=False)
        return loss

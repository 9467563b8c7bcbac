"""Re-point a torch optimizer at Megatron-FSDP's sharded main weights, and global grad-norm clipping."""

import collections
import math
import types
from typing import Optional

import torch

from . import collectives
from .distributed_data_parallel_config import ShardingStrategy
from .optimizer_state import initialize_optimizer_state, optimizer_has_stepped
from .state_dict import (
    load_optimizer_state_dict,
    optimizer_state_dict,
    refresh_optimizer_scalar_replicas,
    refuse_unloaded_optimizer_state_writes,
)
from .utils import WRAPPED_ATTR, called_from_torch_state_dict_helpers


def _find_fsdp_model(optimizer):
    models = set()
    for param_group in optimizer.param_groups:
        for param in param_group["params"]:
            model = getattr(param, WRAPPED_ATTR, None)
            if model is None:
                raise ValueError("the optimizer holds a parameter that is not part of any MegatronFSDP model; "
                                 "build the optimizer from the wrapped model's parameters (after fully_shard_model)")
            models.add(id(model))
            found = model
    if not models:
        raise ValueError("the optimizer holds no parameters")
    if len(models) > 1:
        raise ValueError("the optimizer holds parameters of several MegatronFSDP models; use one per model")
    return found


def _main_weight_views(model, params, names: dict) -> list:
    """The main-weight views the optimizer steps for `params` (parameters of `model`, as the module shows them),
    frozen ones left out; records each view's parameter name in `names`."""
    views = []
    for param in params:
        if id(param) not in model.param_to_group:
            raise ValueError("the optimizer was given a parameter that is not part of its MegatronFSDP model; "
                             "give it parameters of the wrapped model (model.parameters()), or build a separate "
                             "optimizer for tensors outside the model")
        group, index = model.param_to_group[id(param)]
        if not group.trainable:
            continue  # frozen parameters have no main weights
        view = group.main_param_views[index]
        views.append(view)
        names[id(view)] = group.names[index]
    return views


def _loss_of_whole_batch(model, loss):
    """The loss every data-parallel rank agrees on: the mean of the ranks' losses (the sum with
    `calculate_per_token_loss`), whose gradient is the one the reductions produce."""
    value = torch.as_tensor(loss).detach().to(device=model.device, dtype=torch.float64).clone()
    ranks = 1
    for process_group in (model.topology.dp_group, model.topology.outer_group):
        if process_group is not None:
            collectives.all_reduce_scalar_sum(value, process_group)
            ranks *= collectives.group_size(process_group)
    if not model.calculate_per_token_loss:
        value /= ranks
    return value.to(loss.dtype) if isinstance(loss, torch.Tensor) else value.item()


def _make_step_pre_hook(model, agree_on_loss: bool):
    """Before `optimizer.step`: finish gradient sync; with a closure, after each call of the closure instead
    (the closure recomputes the gradients), and install the weights the optimizer moved before calling it again
    (LBFGS re-evaluates the loss at trial points). `agree_on_loss` (LBFGS): the closure's loss is replaced by the
    whole batch's, because the optimizer branches on it (line search, convergence tests) and ranks that branched
    apart would issue different collectives."""

    def before_step(optimizer, args, kwargs):
        _refuse_grad_scaler(optimizer)
        refuse_unloaded_optimizer_state_writes(optimizer)
        # torch passes `self` as args[0]; the closure comes positionally after it or by keyword.
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if closure is None:
            model.finish_grad_sync()
            return None
        calls = [0]

        def synchronising_closure():
            if calls[0]:
                model.install_optimized_model_weights()
            calls[0] += 1
            result = closure()
            model.finish_grad_sync()
            return _loss_of_whole_batch(model, result) if agree_on_loss else result

        return args[:1], {**{k: v for k, v in kwargs.items() if k != "closure"}, "closure": synchronising_closure}

    return before_step


_GRAD_SCALER_MESSAGE = (
    "torch.amp.GradScaler cannot drive a Megatron-FSDP optimizer: its inf/NaN check reads the gradients of the "
    "optimizer's tensors before step(), and those are this rank's shards of the main weights (gradients attached "
    "by step() itself), so the ranks could not agree on skipping a step. Compute in bf16 instead, which needs no "
    "loss scaling (torch.autocast(device_type, dtype=torch.bfloat16), or a bf16 model with MixedPrecisionPolicy("
    "main_params_dtype=torch.float32)); to scale an fp16 loss, multiply it yourself and call "
    "model.scale_gradients(1 / scale) before optimizer.step()")


def _refuse_grad_scaler(optimizer):
    """GradScaler.step() sets `grad_scale` / `found_inf` on an optimizer that handles scaling in its step (see
    `fully_shard_optimizer`) and calls step(): refused there, the attributes removed so a later plain step runs."""
    if not (hasattr(optimizer, "found_inf") or getattr(optimizer, "grad_scale", None) is not None):
        return
    for name in ("grad_scale", "found_inf"):
        if name in optimizer.__dict__:
            delattr(optimizer, name)
    raise RuntimeError(_GRAD_SCALER_MESSAGE)


# Optimizers whose update of an element depends on more than that element of its parameter's gradient and
# state: under strategies 1-3 each rank's optimizer sees flat pieces of rows, not the parameters.
_WHOLE_PARAMETER_OPTIMIZERS = {
    "LBFGS": "its inner products and line search span every parameter",
    "Adafactor": "it factors each matrix's second moment into row and column statistics",
    "Muon": "it orthogonalises each 2-D parameter as a whole matrix",
}


def _check_whole_vector_optimizer(optimizer, model):
    """LBFGS takes inner products and norms over the whole parameter vector, Adafactor and Muon work on each
    matrix whole; a rank's optimizer holds flat pieces of its shard under strategies 1-3, so each would step
    differently (LBFGS, Adafactor: silently) from the same optimizer on one process."""
    if model.strategy == ShardingStrategy.no_shard:
        return
    for name, reason in _WHOLE_PARAMETER_OPTIMIZERS.items():
        kind = getattr(torch.optim, name, None)
        if kind is not None and isinstance(optimizer, kind):
            raise ValueError(f"torch.optim.{name} needs every parameter whole on each rank ({reason}), but "
                             f"zero_dp_strategy='{model.strategy.name}' gives each rank's optimizer flat pieces of "
                             f"its shard only: use zero_dp_strategy='no_shard' (0) with {name}, or an element-wise "
                             "optimizer (Adam, AdamW, SGD, ...) with a sharded strategy")


# torch.distributed.checkpoint.state_dict's get_optimizer_state_dict / get_state_dict key the optimizer's state by
# the module parameters it steps, which a Megatron-FSDP optimizer does not hold (it steps main-weight shards).
_TORCH_STATE_DICT_HELPERS_MESSAGE = (
    "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict / set_optimizer_state_dict / get_state_dict / "
    "set_state_dict cannot map a Megatron-FSDP optimizer's state to parameter names (it steps the sharded main "
    "weights, not the module's parameters): use optimizer.state_dict(), which is already keyed by parameter name "
    "and holds DTensors for torch.distributed.checkpoint, and optimizer.load_state_dict() after dcp.load (for the "
    "model's state get_model_state_dict(model) / set_model_state_dict(model, ...) work, as do model.state_dict() "
    "/ model.load_state_dict())")


class _ShardedOptimizerState(collections.defaultdict):
    """`optimizer.state` of a Megatron-FSDP optimizer. torch's state-dict helpers first test whether it is empty
    (get and set alike); that test raises the error naming the replacement, where they would otherwise fail on
    the first main-weight shard they cannot name (a KeyError printing the tensor)."""

    def __bool__(self):
        if called_from_torch_state_dict_helpers(1):
            raise RuntimeError(_TORCH_STATE_DICT_HELPERS_MESSAGE)
        return len(self) > 0


def _guard_optimizer_state(optimizer):
    if not isinstance(optimizer.state, _ShardedOptimizerState):
        optimizer.state = _ShardedOptimizerState(dict, optimizer.state)


def fully_shard_optimizer(optimizer: torch.optim.Optimizer, preproc_state_dict_for_dcp_ckpt: Optional[bool] = None,
                          install_after_step: bool = True, step_params_without_grads: bool = False):
    """Make `optimizer` step on the sharded fp32 main weights of the MegatronFSDP model owning its params.

    Param groups keep their hyper-parameters; each model parameter is replaced by its main-weight view (its
    shard piece under strategies 1-3). `step()` finishes gradient sync (step pre-hook; after the closure when
    one is given), steps and installs the new weights (step post-hook);
    `zero_grad()` also zeroes the gradient buffers (with several optimizers over one model, once each of them has
    called it: see grad_clearing.py); `add_param_group()` takes the model's parameters (mapped to
    their main weights the same way); `state_dict()` is keyed by parameter name and holds DTensors
    (for torch.distributed.checkpoint, at any data-parallel size), or with `preproc_state_dict_for_dcp_ckpt=False`
    is torch's own index-keyed state dict of this rank's shards (for a per-rank torch.save, reloaded at the same
    data-parallel size). None takes the model's `ddp_config.preproc_state_dict_for_dcp_ckpt`. `state_dict()`
    issues no collective (it may be called on some ranks only), except under HFSDP, whose optimizer state is
    all-gathered over the outer dim (call it on every rank there); see `refresh_optimizer_scalar_replicas`.
    `install_after_step=False` leaves the install to the caller, who calls the model's
    `install_optimized_model_weights()` after each `step()` (to time it apart from the step, for instance).
    Parameters no data-parallel rank gave a gradient since the last `zero_grad()` get no `.grad`, so the step
    leaves them alone as torch's does (ungraded_params.py); `step_params_without_grads=True` steps every
    parameter with its reduced gradient, zeros included, as Megatron's optimizers do.
    `torch.optim.LBFGS` works under no_shard only (refused otherwise); its closure's loss is averaged over the
    data-parallel ranks so that every rank's line search takes the same branches.
    """
    if getattr(optimizer, "_megatron_fsdp_model", None) is not None:
        raise ValueError("this optimizer was already passed to fully_shard_optimizer")
    model = _find_fsdp_model(optimizer)
    if optimizer_has_stepped(optimizer):
        raise ValueError("the optimizer already has state (it has stepped); shard it before the first step")
    _check_whole_vector_optimizer(optimizer, model)
    names = {}
    for param_group in optimizer.param_groups:
        param_group["params"] = _main_weight_views(model, param_group["params"], names)
    if isinstance(optimizer, torch.optim.LBFGS):
        optimizer._params = optimizer.param_groups[0]["params"]  # LBFGS steps its own copy of the list
    optimizer.state.clear()  # state a constructor created (Adagrad's) was keyed by the module's parameters
    _guard_optimizer_state(optimizer)
    # GradScaler then hands its scale to step() (where it is refused with a message) rather than checking the
    # gradients itself, which are not attached before step() and would be per-rank shards.
    optimizer._step_supports_amp_scaling = True
    optimizer._megatron_fsdp_model = model
    optimizer._megatron_fsdp_param_names = names
    optimizer._megatron_fsdp_preproc_for_dcp = (model.ddp_config.preproc_state_dict_for_dcp_ckpt
                                                 if preproc_state_dict_for_dcp_ckpt is None
                                                 else preproc_state_dict_for_dcp_ckpt)
    model.optimizer = optimizer
    model.grad_clearing.register(optimizer)
    model.schedule.leaves_ungraded_params_without_grad = not step_params_without_grads  # see ungraded_params.py
    initialize_optimizer_state(optimizer, sgd_momentum=True)

    original_zero_grad = optimizer.zero_grad
    optimizer._megatron_fsdp_step_hooks = (
        optimizer.register_step_pre_hook(_make_step_pre_hook(model, isinstance(optimizer, torch.optim.LBFGS))),)
    if install_after_step:
        optimizer._megatron_fsdp_step_hooks += (
            optimizer.register_step_post_hook(lambda opt, args, kwargs: model.install_optimized_model_weights()),)
    # So that state_dict() needs no communication (0-dim parameters' state lives on data-parallel rank 0 only).
    optimizer._megatron_fsdp_step_hooks += (
        optimizer.register_step_post_hook(lambda opt, args, kwargs: refresh_optimizer_scalar_replicas(opt)),)
    refresh_optimizer_scalar_replicas(optimizer)

    def zero_grad(self, set_to_none: bool = True):
        original_zero_grad(set_to_none=set_to_none)
        model.zero_grad_buffer_for(self)

    def state_dict(self):
        if called_from_torch_state_dict_helpers(1):
            raise RuntimeError(_TORCH_STATE_DICT_HELPERS_MESSAGE)
        if not self._megatron_fsdp_preproc_for_dcp:
            return self._megatron_fsdp_original_state_dict()
        return optimizer_state_dict(self)

    def load_state_dict(self, state_dict):
        return load_optimizer_state_dict(self, state_dict)

    original_add_param_group = optimizer.add_param_group

    def add_param_group(self, param_group):
        """`torch.optim.Optimizer.add_param_group` with the model's parameters, mapped to their main weights."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        views = _main_weight_views(model, params, self._megatron_fsdp_param_names)
        original_add_param_group({**param_group, "params": views})
        initialize_optimizer_state(self, sgd_momentum=True)
        refresh_optimizer_scalar_replicas(self)

    optimizer.add_param_group = types.MethodType(add_param_group, optimizer)
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)
    optimizer.state_dict = types.MethodType(state_dict, optimizer)
    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)
    def original_load_state_dict(state_dict):
        torch.optim.Optimizer.load_state_dict(optimizer, state_dict)
        _guard_optimizer_state(optimizer)  # torch's load replaces `optimizer.state`

    optimizer._megatron_fsdp_original_load_state_dict = original_load_state_dict
    optimizer._megatron_fsdp_original_state_dict = torch.optim.Optimizer.state_dict.__get__(optimizer)
    return optimizer


def clip_grad_norm_(optimizer_or_model, max_norm: float, norm_type: float = 2.0,
                    eps: float = 1e-6) -> torch.Tensor:
    """Clip the gradients of a sharded model by their global norm (each element counted once); returns the
    norm before clipping, as a tensor on the model's device. Finishes gradient synchronisation first.

    One foreach norm kernel for all gradients, one foreach multiply to clip them, and no host synchronisation:
    the clip coefficient stays a device tensor (clamped to 1, so gradients under `max_norm` are multiplied by 1)."""
    model = getattr(optimizer_or_model, "_megatron_fsdp_model", optimizer_or_model)
    if getattr(model, "expert_topology", None) is not None:
        # An expert's gradient norm is summed over the ranks holding the other experts too (the expert-parallel
        # group), which the package is not given.
        raise ValueError("clip_grad_norm_ does not know the expert-parallel group of a model with expert groups "
                         "(expt_device_mesh); clip with Megatron's optimizer (MegatronFSDPOptimizer), which "
                         "reduces expert gradient norms over the expert-parallel and expert data-parallel groups")
    model.finish_grad_sync()
    norm_type = float(norm_type)
    # TP ranks hold different partitions of tensor-parallel parameters (marked `tensor_model_parallel`) and the
    # same copy of the others: summed over the tp group, those enter at 1/tp_size so they count once.
    tp_size = model.topology.tp_size
    partitioned, replicated = [], []
    for group in model.groups:
        for grad, param in zip(group.optimizer_grad_views(), group.params):
            if grad.numel():
                is_partitioned = tp_size == 1 or getattr(param, "tensor_model_parallel", False)
                (partitioned if is_partitioned else replicated).append(grad)
    # Groups holding disjoint pieces of the gradients: the shard ranks, and under HFSDP the outer ranks too
    # (HSDP's outer ranks hold identical copies and must not be counted twice).
    groups = [] if model.strategy == ShardingStrategy.no_shard else [model.topology.dp_group]
    if model.topology.outer_shards_optimizer:
        groups.append(model.topology.outer_group)
    if tp_size > 1:
        groups.append(model.topology.tp_group)

    def norms(grads):
        return torch.stack(torch._foreach_norm(grads, norm_type, dtype=torch.float32)) if grads else None

    local = torch.zeros((), dtype=torch.float32, device=model.device)
    if math.isinf(norm_type):
        for part in (norms(partitioned), norms(replicated)):
            if part is not None:
                local = torch.maximum(local, part.max())
        for process_group in groups:
            collectives.all_reduce_max(local, process_group)
        total = local
    else:
        for part, weight in ((norms(partitioned), 1.0), (norms(replicated), 1.0 / tp_size)):
            if part is not None:
                local = local + part.pow(norm_type).sum() * weight
        for process_group in groups:
            collectives.all_reduce_scalar_sum(local, process_group)
        total = local.pow(1.0 / norm_type)
    grads = partitioned + replicated
    if grads:
        torch._foreach_mul_(grads, (max_norm / (total + eps)).clamp(max=1.0))
    return total


def optimizer_param_name(optimizer, tensor) -> Optional[str]:
    return optimizer._megatron_fsdp_param_names.get(id(tensor))

"""Entry points: `fully_shard_model`, `fully_shard_optimizer` and `fully_shard` (both at once)."""

import dataclasses
from typing import Optional, Tuple, Union

import torch

from .distributed_data_parallel_config import DistributedDataParallelConfig, ShardingStrategy
from .megatron_fsdp import MegatronFSDP
from .mixed_precision import MixedPrecisionPolicy
from .nccl_allocator import NcclUserBuffers
from .optimizer import fully_shard_optimizer
from .optimizer_state import state_records_step


def fully_shard_model(
    module: torch.nn.Module,
    device_mesh=None,
    dp_shard_dim=None,
    dp_outer_dim=None,
    tp_dim=None,
    hybrid_fsdp_group=None,
    fsdp_unit_modules=None,
    zero_dp_strategy: Union[str, int, ShardingStrategy] = 3,
    outer_dp_sharding_strategy: Union[str, int, ShardingStrategy] = 0,
    device: Optional[torch.device] = None,
    init_model_with_meta_device: bool = False,
    mixed_precision_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = True,
    sync_model_each_microbatch: bool = True,
    preproc_state_dict_for_dcp_ckpt: bool = True,
    report_nan_in_param_grad: bool = False,
    average_in_collective: bool = False,
    disable_bucketing: bool = False,
    calculate_per_token_loss: bool = False,
    fsdp_double_buffer: bool = False,
    maxpool_double_buffer: bool = False,
    param_offload: bool = False,
    expt_device_mesh=None,
    is_expert_param=None,
    nccl_user_buffers=None,
    expt_hybrid_fsdp_group=None,
    grad_reduce_in_fp32: bool = False,
    preserve_fp32_weights: Optional[bool] = None,
    check_for_nan_in_grad: Optional[bool] = None,
    nccl_ub: bool = False,
    disable_symmetric_registration: bool = False,
) -> MegatronFSDP:
    """Shard `module` over the data-parallel ranks (a 1-D mesh over the world when no mesh is given).

    `fsdp_unit_modules`: classes (or dotted names) whose outermost instances become gather/reduce units.
    `zero_dp_strategy`: no_shard (0) | optim (1) | optim_grads (2) | optim_grads_params (3).
    `dp_outer_dim` + `hybrid_fsdp_group`: replicate across the outer dim (HSDP, `outer_dp_sharding_strategy=
    "no_shard"`), or also shard main weights, gradients and optimizer state across it (HFSDP, `"optim"`).
    `tp_dim`: the mesh dim of Megatron tensor parallelism (state dicts then hold TP-full DTensors).
    `fsdp_double_buffer` / `maxpool_double_buffer` (either one): units gather into a fixed pool of two buffers,
    each sized to the largest unit (the max over units), instead of allocating per gather.
    `param_offload` (strategy 3): parameter shards, main weights and gradient shards rest in (pinned) host memory;
    each unit's gather copies the shard to the device (see offload.py).
    `expt_device_mesh` (+ `is_expert_param`): shard Mixture-of-Experts expert parameters over the mesh of the
    ranks holding the same experts instead (see `MegatronFSDP`); with `dp_outer_dim` the expert mesh has that dim
    too and `expt_hybrid_fsdp_group` spans its outer x shard ranks.
    `nccl_user_buffers` (an `NcclUserBuffers`): allocate the buffers from a memory pool registered with NCCL
    (see nccl_allocator.py; plain allocations on CPU / gloo).
    Keywords of upstream's earlier signature work too: `grad_reduce_in_fp32` (DistributedDataParallelConfig's),
    `preserve_fp32_weights=False` (`MixedPrecisionPolicy(main_params_dtype=None)`: no fp32 copy of the weights),
    `check_for_nan_in_grad` (`report_nan_in_param_grad`), `nccl_ub` / `disable_symmetric_registration`
    (`nccl_user_buffers=NcclUserBuffers(symmetric=not disable_symmetric_registration)`).
    """
    mixed_precision_policy = _apply_preserve_fp32_weights(mixed_precision_policy, preserve_fp32_weights)
    if check_for_nan_in_grad is not None:
        if report_nan_in_param_grad and not check_for_nan_in_grad:
            raise ValueError("check_for_nan_in_grad=False contradicts report_nan_in_param_grad=True (the same "
                             "setting under its earlier name); pass one of them")
        report_nan_in_param_grad = check_for_nan_in_grad
    if nccl_ub:
        if nccl_user_buffers is not None:
            raise ValueError("pass nccl_ub=True or nccl_user_buffers, not both (nccl_ub=True is "
                             "nccl_user_buffers=NcclUserBuffers(symmetric=not disable_symmetric_registration))")
        nccl_user_buffers = NcclUserBuffers(symmetric=not disable_symmetric_registration)
    # Both overlaps default to on, so turning off overlap_grad_reduce alone turns off overlap_param_gather with
    # it rather than tripping the config's rule that the second needs the first.
    config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather and overlap_grad_reduce,
        use_distributed_optimizer=True,
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=ShardingStrategy.parse(zero_dp_strategy),
        outer_dp_sharding_strategy=ShardingStrategy.parse(outer_dp_sharding_strategy, "outer_dp_sharding_strategy"),
        average_in_collective=average_in_collective,
        fsdp_double_buffer=fsdp_double_buffer or maxpool_double_buffer,
        check_for_nan_in_grad=report_nan_in_param_grad,
        preproc_state_dict_for_dcp_ckpt=preproc_state_dict_for_dcp_ckpt,
        param_offload=param_offload,
    )
    return MegatronFSDP(
        module,
        config,
        device_mesh=device_mesh,
        dp_shard_dim=dp_shard_dim,
        dp_outer_dim=dp_outer_dim,
        tp_dim=tp_dim,
        hybrid_fsdp_group=hybrid_fsdp_group,
        fsdp_unit_modules=fsdp_unit_modules,
        mixed_precision_policy=mixed_precision_policy,
        device=device,
        init_model_with_meta_device=init_model_with_meta_device,
        sync_model_each_microbatch=sync_model_each_microbatch,
        disable_bucketing=disable_bucketing,
        calculate_per_token_loss=calculate_per_token_loss,
        report_nan_in_param_grad=report_nan_in_param_grad,
        expt_device_mesh=expt_device_mesh,
        expt_hybrid_fsdp_group=expt_hybrid_fsdp_group,
        is_expert_param=is_expert_param,
        nccl_user_buffers=nccl_user_buffers,
    )


def _apply_preserve_fp32_weights(policy: MixedPrecisionPolicy,
                                 preserve_fp32_weights: Optional[bool]) -> MixedPrecisionPolicy:
    """Upstream's `preserve_fp32_weights=False`: the compute weights act as the main weights (no fp32 copy)."""
    if preserve_fp32_weights is None:
        return policy
    if preserve_fp32_weights:
        if policy.main_params_dtype is None:
            raise ValueError("preserve_fp32_weights=True contradicts MixedPrecisionPolicy(main_params_dtype=None); "
                             "pass preserve_fp32_weights=False or a main_params_dtype")
        return policy
    if policy.main_params_dtype not in (None, torch.float32):
        raise ValueError(f"preserve_fp32_weights=False contradicts MixedPrecisionPolicy(main_params_dtype="
                         f"{policy.main_params_dtype}); pass one of them")
    return dataclasses.replace(policy, main_params_dtype=None)


def fully_shard(module: torch.nn.Module, optimizer: torch.optim.Optimizer, **kwargs) -> Tuple[MegatronFSDP,
                                                                                                torch.optim.Optimizer]:
    """`fully_shard_model(module, **kwargs)` then `fully_shard_optimizer(optimizer)`; returns both.

    The optimizer must have been built from `module`'s parameters, before or after wrapping. A meta-device
    model's parameters are replaced when it is materialised; an optimizer built on them before wrapping is
    re-pointed at the materialised parameters of the same names.
    """
    preproc = kwargs.get("preproc_state_dict_for_dcp_ckpt", True)
    names_before = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names_before.setdefault(id(param), name)
    model = fully_shard_model(module, **kwargs)
    _rebind_replaced_params(optimizer, names_before, model)
    return model, fully_shard_optimizer(optimizer, preproc_state_dict_for_dcp_ckpt=preproc)


def _rebind_replaced_params(optimizer: torch.optim.Optimizer, names_before: dict, model: MegatronFSDP):
    """Point `optimizer` at the wrapped model's parameters where wrapping replaced the ones it was built on."""
    params_now = dict(model.module.named_parameters(remove_duplicate=False))
    for param_group in optimizer.param_groups:
        rebound = []
        for param in param_group["params"]:
            if id(param) not in model.param_to_group and id(param) in names_before:
                if state_records_step(optimizer.state.get(param, {})):
                    raise ValueError(f"the optimizer already has state for '{names_before[id(param)]}'; "
                                     "wrap the model before the first optimizer step")
                param = params_now[names_before[id(param)]]
            rebound.append(param)
        param_group["params"] = rebound


__all__ = ["fully_shard_model", "fully_shard_optimizer", "fully_shard"]

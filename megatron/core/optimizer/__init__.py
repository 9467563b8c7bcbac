"""`get_megatron_optimizer`: param groups, the torch optimizer, and the precision/sharding wrapper around it.

Parameter groups: weights get `config.weight_decay`; biases and 1-D parameters (norms) get none, nor, with
`default_skip_embedding_weight_decay` (`--embedding-init-method-std`), the embedding weights
(`is_embedding_parameter`: word and learned position embeddings, and a tied output layer's copy of the word
embedding), so they do not shrink towards zero; `no_weight_decay_cond(name, param)`, when given, decides instead
of these defaults (`no_weight_decay_cond_for` builds upstream's named alternatives, `--no-weight-decay-cond-type`).
`scale_lr_cond(name, param)` selects parameters whose learning rate is multiplied by
`lr_mult`. Each group carries `wd_mult` and `lr_mult`, which the `OptimizerParamScheduler` applies when it sets
`lr` and `weight_decay` every step. With `config.decoupled_lr` the word-embedding and output-layer weights
(`is_embedding_or_output_parameter`) form groups of their own whose `max_lr` / `min_lr` (`decoupled_lr`,
`decoupled_min_lr` or else `min_lr`) the scheduler uses instead of the global ones. With `optimizer='muon'`
`muon_param_groups` (muon_param_groups.py) moves the hidden weight matrices of every group into Muon groups of
their own.
"""

import torch

from megatron.core import optional_deps
from megatron.core.expert_parameters import (
    expert_data_parallel_group,
    expert_grad_stats_groups,
    model_has_expert_parameters,
)
from megatron.core.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
    global_norm_fp32,
    global_norms_fp32,
    param_is_not_shared,
    param_is_not_tensor_parallel_duplicate,
)
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.fsdp_optimizer import MegatronFSDPOptimizer
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.core.optimizer.muon import MuonWithAdamW
from megatron.core.optimizer.muon_param_groups import muon_param_groups
from megatron.core.optimizer.optimizer import ChainedOptimizer, Float16Optimizer, FP32Optimizer, MegatronOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.precision_aware_adam import PrecisionAwareAdamW, build_precision_aware_adam
from megatron.core.optimizer.shard_local_adam import ShardLocalAdamW

__all__ = [
    "OptimizerConfig",
    "MegatronOptimizer",
    "FP32Optimizer",
    "Float16Optimizer",
    "ChainedOptimizer",
    "DistributedOptimizer",
    "MegatronFSDPOptimizer",
    "PrecisionAwareAdamW",
    "ShardLocalAdamW",
    "MuonWithAdamW",
    "ConstantGradScaler",
    "DynamicGradScaler",
    "get_megatron_optimizer",
    "get_param_groups",
    "no_weight_decay_cond_for",
    "get_grad_norm_fp32",
    "global_norm_fp32",
    "global_norms_fp32",
    "clip_grad_by_total_norm_fp32",
    "count_zeros_fp32",
    "param_is_not_shared",
    "param_is_not_tensor_parallel_duplicate",
]


def _default_no_weight_decay(name, param):
    return name.endswith(".bias") or param.dim() == 1


def _default_no_weight_decay_nor_on_embeddings(name, param):
    return _default_no_weight_decay(name, param) or getattr(param, "is_embedding_parameter", False)


# `--no-weight-decay-cond-type` values, as upstream.
NO_WEIGHT_DECAY_COND_TYPES = ("apply_wd_to_qk_layernorm",)


def no_weight_decay_cond_for(cond_type, default_skip_embedding_weight_decay=False):
    """The `no_weight_decay_cond` of `--no-weight-decay-cond-type` (None: the defaults of `get_param_groups`).

    `apply_wd_to_qk_layernorm` (Qwen3-Next): the query / key norms' parameters (`q_layernorm` or `k_layernorm` in
    the name; a LayerNorm's bias too, as upstream) are weight-decayed although they are 1-D; every other parameter
    follows the defaults."""
    if cond_type is None:
        return None
    if cond_type not in NO_WEIGHT_DECAY_COND_TYPES:
        raise ValueError(f"--no-weight-decay-cond-type must be one of {NO_WEIGHT_DECAY_COND_TYPES}, got {cond_type!r}")
    default = (_default_no_weight_decay_nor_on_embeddings if default_skip_embedding_weight_decay
               else _default_no_weight_decay)

    def apply_wd_to_qk_layernorm(name, param):
        if "q_layernorm" in name or "k_layernorm" in name:
            return False
        return default(name, param)

    return apply_wd_to_qk_layernorm


def get_param_groups(model_chunks, config, no_weight_decay_cond=None, scale_lr_cond=None, lr_mult=1.0,
                     default_skip_embedding_weight_decay=False):
    """Groups keyed by (wd_mult, lr_mult, decoupled lr), weight-decayed group first; each parameter appears once."""
    if no_weight_decay_cond is None:
        no_weight_decay_cond = (_default_no_weight_decay_nor_on_embeddings if default_skip_embedding_weight_decay
                                else _default_no_weight_decay)
    decoupled_lr = getattr(config, "decoupled_lr", None)
    grouped, seen = {}, set()
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            wd_mult = 0.0 if no_weight_decay_cond(name, param) else 1.0
            group_lr_mult = lr_mult if scale_lr_cond is not None and scale_lr_cond(name, param) else 1.0
            decoupled = decoupled_lr is not None and getattr(param, "is_embedding_or_output_parameter", False)
            grouped.setdefault((wd_mult, group_lr_mult, decoupled), []).append(param)
    groups = []
    for (wd_mult, group_lr_mult, decoupled), params in sorted(grouped.items(),
                                                               key=lambda item: (-item[0][0], *item[0][1:])):
        group = {"params": params, "wd_mult": wd_mult, "lr_mult": group_lr_mult,
                 "weight_decay": config.weight_decay * wd_mult, "lr": config.lr * group_lr_mult}
        if decoupled:
            decoupled_min_lr = config.decoupled_min_lr if config.decoupled_min_lr is not None else config.min_lr
            group.update(lr=decoupled_lr * group_lr_mult, max_lr=decoupled_lr, min_lr=decoupled_min_lr or 0.0)
        groups.append(group)
    return groups


def _torch_optimizer_factory(config, device):
    def build(groups):
        if config.use_precision_aware_optimizer:
            return build_precision_aware_adam(groups, config, device)
        if config.optimizer == "adam" and optional_deps.HAVE_APEX and device.type == "cuda":
            from apex.optimizers import FusedAdam

            return FusedAdam(groups, lr=config.lr, weight_decay=config.weight_decay,
                             betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps, adam_w_mode=True)
        implementation = {"fused": True} if device.type == "cuda" else {"foreach": True}
        if config.optimizer == "muon":
            return MuonWithAdamW(groups, lr=config.lr, weight_decay=config.weight_decay,
                                 betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps, **implementation)
        if config.optimizer == "adam":
            return ShardLocalAdamW(groups, lr=config.lr, weight_decay=config.weight_decay,
                                   betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                                   **implementation)
        return torch.optim.SGD(groups, lr=config.lr, weight_decay=config.weight_decay,
                               momentum=config.sgd_momentum, foreach=True)

    if config.optimizer_cpu_offload:
        from megatron.core.optimizer.cpu_offloading import hybrid_optimizer_factory

        return hybrid_optimizer_factory(config, build)
    return build


def _grad_scaler(config, device):
    """As upstream: a static `loss_scale` scales the loss under every optimizer that keeps main parameters of its
    own (fp16, bf16, the distributed optimizer, Megatron-FSDP; a plain fp32 optimizer ignores it); only fp16
    without one scales dynamically."""
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale, device=device)
    if not config.fp16:
        return None
    return DynamicGradScaler(
        initial_scale=config.initial_loss_scale,
        min_scale=config.min_loss_scale,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=config.loss_scale_window,
        hysteresis=config.hysteresis,
        device=device,
    )


def _communication_groups(model_chunks, use_distributed_optimizer):
    """(grad_stats_groups, found_inf_groups): model-parallel group plus the relevant data-parallel group."""
    from megatron.core import parallel_state

    initialized = parallel_state.model_parallel_is_initialized()
    model_parallel = [parallel_state.get_model_parallel_group()] if initialized else []
    ddp_groups = getattr(model_chunks[0], "groups", None)
    if ddp_groups is not None:
        data_parallel, shard_group = ddp_groups.data_parallel_group, ddp_groups.shard_group
    elif initialized:
        data_parallel = shard_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    else:
        data_parallel = shard_group = None
    grad_stats = model_parallel + ([shard_group] if use_distributed_optimizer and shard_group is not None else [])
    found_inf = model_parallel + ([data_parallel] if data_parallel is not None else [])
    return grad_stats, found_inf


def _expert_grad_stats_groups(model_chunks, use_distributed_optimizer):
    """Where expert gradient statistics are reduced, or None when no rank has expert parameters (collective)."""
    if not model_has_expert_parameters(model_chunks):
        return None
    shard_group = None
    if use_distributed_optimizer:
        expert_groups = getattr(model_chunks[0], "expert_groups", None)
        shard_group = expert_groups.shard_group if expert_groups is not None else expert_data_parallel_group()
    return expert_grad_stats_groups(shard_group)


def _megatron_fsdp_optimizer(config, model_chunks, no_weight_decay_cond, scale_lr_cond, lr_mult,
                             default_skip_embedding_weight_decay):
    """The optimizer of Megatron-FSDP chunks: it steps their sharded main weights (their own ZeRO level decides
    the sharding, whatever `config.use_distributed_optimizer` says)."""
    from megatron.core import parallel_state

    for name, flag in (("main_params_dtype", "--megatron-fsdp-main-params-dtype"),
                       ("main_grads_dtype", "--megatron-fsdp-main-grads-dtype")):
        if getattr(config, name) != torch.float32:
            raise ValueError(
                f"OptimizerConfig.{name} (--{name.replace('_', '-')}) is for the distributed optimizer; Megatron-FSDP "
                f"keeps its main weights and gradients in the dtypes of {flag}: use that instead."
            )
    param_groups = get_param_groups(model_chunks, config, no_weight_decay_cond, scale_lr_cond, lr_mult,
                                    default_skip_embedding_weight_decay)
    if config.optimizer == "muon":
        param_groups = muon_param_groups(param_groups, model_chunks, config)
    device = model_chunks[0].device
    if model_chunks[0].ddp_config.megatron_fsdp_param_offload:
        device = torch.device("cpu")  # the main weights it steps rest in host memory
    if parallel_state.model_parallel_is_initialized():
        model_parallel_groups = [parallel_state.get_model_parallel_group()]
        data_parallel_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    else:
        model_parallel_groups, data_parallel_group = [], model_chunks[0].data_parallel_group
    return MegatronFSDPOptimizer(param_groups, _torch_optimizer_factory(config, device), config, model_chunks,
                                 _grad_scaler(config, device), model_parallel_groups, data_parallel_group)


def get_megatron_optimizer(config: OptimizerConfig, model_chunks, no_weight_decay_cond=None, scale_lr_cond=None,
                           lr_mult=1.0, use_gloo_process_groups=True, default_skip_embedding_weight_decay=False):
    """Build the optimizer for `model_chunks` (DDP-wrapped or plain modules) as `config` asks; every wrapper's
    param groups come from `get_param_groups` (see the module docstring for the arguments). The arguments are
    upstream's, in upstream's order; `use_gloo_process_groups` (`--disable-gloo-process-groups`) has nothing to
    choose here: the optimizers' checkpoint collectives run on the model's own data-parallel groups."""
    del use_gloo_process_groups
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import MegatronFSDPAdapter

    if any(isinstance(chunk, MegatronFSDPAdapter) for chunk in model_chunks):
        return _megatron_fsdp_optimizer(config, model_chunks, no_weight_decay_cond, scale_lr_cond, lr_mult,
                                        default_skip_embedding_weight_decay)
    for chunk in model_chunks:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None and ddp_config.use_distributed_optimizer != config.use_distributed_optimizer:
            raise ValueError(
                f"OptimizerConfig.use_distributed_optimizer={config.use_distributed_optimizer} but the model was "
                f"wrapped with DistributedDataParallelConfig.use_distributed_optimizer="
                f"{ddp_config.use_distributed_optimizer}; set both from --use-distributed-optimizer."
            )
    param_groups = get_param_groups(model_chunks, config, no_weight_decay_cond, scale_lr_cond, lr_mult,
                                    default_skip_embedding_weight_decay)
    if config.optimizer == "muon":
        param_groups = muon_param_groups(param_groups, model_chunks, config)
    all_params = [param for group in param_groups for param in group["params"]]
    device = all_params[0].device if all_params else torch.device("cpu")
    factory = _torch_optimizer_factory(config, device)
    grad_scaler = _grad_scaler(config, device)
    grad_stats_groups, found_inf_groups = _communication_groups(model_chunks, config.use_distributed_optimizer)
    expert_groups = _expert_grad_stats_groups(model_chunks, config.use_distributed_optimizer)

    if config.use_distributed_optimizer:
        return DistributedOptimizer(param_groups, factory, config, model_chunks, grad_scaler, grad_stats_groups,
                                    found_inf_groups, expert_groups)
    has_half_params = any(param.dtype in (torch.float16, torch.bfloat16) for param in all_params)
    if config.fp16 or config.bf16 or has_half_params:
        optimizer = Float16Optimizer(param_groups, factory, config, grad_scaler, grad_stats_groups, found_inf_groups,
                                     expert_groups)
    else:
        optimizer = FP32Optimizer(factory(param_groups), config, None, grad_stats_groups, found_inf_groups,
                                  expert_groups)
    optimizer.model_chunks = list(model_chunks)  # what `sharded_state_dict` checkpoints
    return optimizer

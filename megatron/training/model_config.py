"""Core config dataclasses built from the parsed command line."""

import torch


def params_dtype_from_args(args):
    if args.bf16:
        return torch.bfloat16
    if args.fp16:
        return torch.float16
    return torch.float32


def core_transformer_config_from_args(args, config_class=None):
    """The `TransformerConfig` (model shape, parallel sizes, precision, recompute) the flags describe."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training.argument_groups.fp8 import transformer_config_kwargs as fp8_config_kwargs
    from megatron.training.argument_groups.heterogeneous import transformer_config_kwargs as heterogeneous_kwargs
    from megatron.training.argument_groups.hybrid import transformer_config_kwargs as hybrid_config_kwargs
    from megatron.training.argument_groups.memory import transformer_config_kwargs as memory_config_kwargs
    from megatron.training.argument_groups.numerics import transformer_config_kwargs as numerics_config_kwargs
    from megatron.training.argument_groups.moe import transformer_config_kwargs as moe_config_kwargs
    from megatron.training.argument_groups.mla import transformer_config_kwargs as mla_config_kwargs
    from megatron.training.argument_groups.model import transformer_config_kwargs as model_config_kwargs
    from megatron.training.argument_groups.communication import (
        transformer_config_kwargs as communication_config_kwargs,
    )
    from megatron.training.argument_groups.pipeline_split import transformer_config_kwargs as split_config_kwargs
    from megatron.training.argument_groups.mtp import transformer_config_kwargs as mtp_config_kwargs
    from megatron.training.argument_groups.qk_clip import transformer_config_kwargs as qk_clip_config_kwargs
    from megatron.training.argument_groups.attention_variants import (
        transformer_config_kwargs as attention_variants_config_kwargs,
    )
    from megatron.training.argument_groups.attention_head_transforms import (
        transformer_config_kwargs as attention_head_transforms_config_kwargs,
    )

    config_class = config_class or TransformerConfig
    return config_class(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups,
        qk_layernorm=args.qk_layernorm,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        init_seed=args.seed,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        gated_linear_unit=args.swiglu or getattr(args, "quick_geglu", False),
        **model_config_kwargs(args),
        **communication_config_kwargs(args),
        add_bias_linear=args.add_bias_linear,
        recompute_granularity=args.recompute_granularity,
        distribute_saved_activations=args.distribute_saved_activations,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        recompute_modules=getattr(args, "recompute_modules", None),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=getattr(args, "virtual_pipeline_model_parallel_size", None),
        microbatch_group_size_per_vp_stage=getattr(args, "microbatch_group_size_per_virtual_pipeline_stage", None),
        **split_config_kwargs(args),
        context_parallel_size=args.context_parallel_size,
        cp_comm_type=getattr(args, "cp_comm_type", "p2p"),
        hierarchical_context_parallel_sizes=getattr(args, "hierarchical_context_parallel_sizes", None),
        sequence_parallel=args.sequence_parallel,
        fp16=args.fp16,
        bf16=args.bf16,
        params_dtype=params_dtype_from_args(args),
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        calculate_per_token_loss=args.calculate_per_token_loss,
        init_model_with_meta_device=args.init_model_with_meta_device,
        **fp8_config_kwargs(args),
        **numerics_config_kwargs(args),
        **memory_config_kwargs(args),
        **mla_config_kwargs(args),
        **moe_config_kwargs(args),
        **mtp_config_kwargs(args),
        **qk_clip_config_kwargs(args),
        **attention_variants_config_kwargs(args),
        **attention_head_transforms_config_kwargs(args),
        **hybrid_config_kwargs(args),
        **heterogeneous_kwargs(args),
    )


def optimizer_config_from_args(args):
    from megatron.core.optimizer import OptimizerConfig
    from megatron.training.argument_groups.memory import optimizer_config_kwargs
    from megatron.training.argument_groups.muon import optimizer_config_kwargs as muon_optimizer_config_kwargs
    from megatron.training.global_state import timers_or_none

    return OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=params_dtype_from_args(args),
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        use_distributed_optimizer=args.use_distributed_optimizer,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
        barrier_with_L1_time=args.barrier_with_L1_time,
        timers=timers_or_none(),
        **optimizer_config_kwargs(args),
        **muon_optimizer_config_kwargs(args),
    )


def ddp_config_from_args(args):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.training.argument_groups.memory import ddp_config_kwargs as memory_ddp_config_kwargs
    from megatron.training.argument_groups.data_parallel_tuning import ddp_config_kwargs as tuning_ddp_config_kwargs

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        bucket_size=args.ddp_bucket_size,
        average_in_collective=args.ddp_average_in_collective,
        fp8_param_gather=args.fp8_param_gather,
        use_torch_fsdp2=getattr(args, "use_torch_fsdp2", False),
        torch_fsdp2_reshard_after_forward=getattr(args, "torch_fsdp2_reshard_after_forward", True),
        **megatron_fsdp_config_kwargs(args),
        **memory_ddp_config_kwargs(args),
        **tuning_ddp_config_kwargs(args),
    )


def megatron_fsdp_config_kwargs(args):
    """The Megatron-FSDP fields of DistributedDataParallelConfig (defaults when --use-megatron-fsdp is off)."""
    from megatron.training.argument_groups.data_parallel import megatron_fsdp_dtype
    from megatron.training.argument_groups.nccl_buffers import ddp_config_kwargs as nccl_buffers_ddp_config_kwargs

    if not args.use_megatron_fsdp:
        return {}
    return dict(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=args.data_parallel_sharding_strategy,
        outer_dp_sharding_strategy=args.outer_dp_sharding_strategy,
        fsdp_double_buffer=args.fsdp_double_buffer,
        megatron_fsdp_main_params_dtype=megatron_fsdp_dtype(args.megatron_fsdp_main_params_dtype),
        megatron_fsdp_main_grads_dtype=megatron_fsdp_dtype(args.megatron_fsdp_main_grads_dtype),
        megatron_fsdp_grad_comm_dtype=megatron_fsdp_dtype(args.megatron_fsdp_grad_comm_dtype),
        **nccl_buffers_ddp_config_kwargs(args),
    )

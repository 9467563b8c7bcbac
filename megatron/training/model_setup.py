"""Builds what `pretrain()` trains: the model chunk of this pipeline stage (DDP-wrapped), the optimizer and
the learning-rate / weight-decay scheduler, and installs the gradient hooks the pipeline schedules call."""

import dataclasses
import inspect

import torch

from megatron.core import parallel_state
from megatron.training.model_config import ddp_config_from_args, optimizer_config_from_args


def get_model(model_provider_func, args, wrap_with_ddp=True):
    """[model chunk] for this pipeline stage, on this process's device, wrapped for data parallelism; with an
    interleaved pipeline one chunk per virtual stage of this rank, each wrapped on its own.

    The wrapper follows the flags: Megatron's DDP (default, also with one data-parallel rank: it owns the
    contiguous gradient buffers the optimizer reads as `param.main_grad`), Megatron-FSDP
    (`--use-megatron-fsdp`) or PyTorch FSDP2 (`--use-torch-fsdp2`). All three implement
    `megatron.core.distributed.DataParallelWrapper` (`no_sync`, `finish_grad_sync`, `zero_grad_buffer`,
    `scale_gradients`, `state_bytes`, ...).
    With `--init-model-with-meta-device` the model is built on the meta device and materialised by the FSDP
    wrapper unit by unit, each rank keeping only its shard.

    The model is built with the default CPU generator seeded with the un-offset `--seed` (the per-stage offset
    `set_random_seed` applies is for dropout), so a model whose config leaves `init_seed` unset still starts
    from the same weights on every pipeline layout; the generator state is restored afterwards.

    Before wrapping, data-parallel rank 0 of context-parallel rank 0 prints the parameter count of its chunks
    (` > number of parameters on (tensor, pipeline) model parallel rank (T, P): N`, as upstream).
    """
    num_chunks = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    chunks = [_build_chunk(model_provider_func, args, chunk if num_chunks > 1 else None)
              for chunk in range(num_chunks)]
    print_parameter_count(chunks)
    if not wrap_with_ddp:
        return chunks
    from megatron.training.argument_groups.data_parallel_tuning import bucket_size_for

    bucket_size = bucket_size_for(args, chunks)
    return [wrap_model_chunk(chunk, args, bucket_size) for chunk in chunks]


def print_parameter_count(chunks):
    """Upstream's line: the parameters of this rank's model chunks, printed once per (tensor, pipeline) rank."""
    if parallel_state.get_data_parallel_rank() != 0 or parallel_state.get_context_parallel_rank() != 0:
        return
    num_parameters = sum(param.nelement() for chunk in chunks for param in chunk.parameters())
    print(f" > number of parameters on (tensor, pipeline) model parallel rank "
          f"({parallel_state.get_tensor_model_parallel_rank()}, {parallel_state.get_pipeline_model_parallel_rank()}): "
          f"{num_parameters}", flush=True)


def _accepts_vp_stage(model_provider_func):
    try:
        parameters = inspect.signature(model_provider_func).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "vp_stage" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _build_chunk(model_provider_func, args, vp_stage):
    """One model chunk: the stage's model, or with an interleaved pipeline the chunk `vp_stage` (virtual stage
    `vp_stage * p + pipeline rank`; the virtual pipeline rank is set while it is built, so the model takes the
    layers of that virtual stage and `is_pipeline_first_stage()` / `is_pipeline_last_stage()` answer for it).
    With an interleaved pipeline a provider that takes `vp_stage` (upstream's signature) also gets it."""
    stage_kwargs = {"vp_stage": vp_stage} if vp_stage is not None and _accepts_vp_stage(model_provider_func) else {}
    parallel_state.set_virtual_pipeline_model_parallel_rank(vp_stage)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(args.seed)
            model = model_provider_func(
                pre_process=parallel_state.is_pipeline_first_stage(),
                post_process=parallel_state.is_pipeline_last_stage(),
                **stage_kwargs,
            )
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_rank(None)
    if not any(param.is_meta for param in model.parameters()):
        model.to(args.device)
    return model


def wrap_model_chunk(model, args, bucket_size=None):
    """`model` wrapped for data parallelism: the config built from the flags picks the wrapper (DDP,
    Megatron-FSDP or FSDP2, see `megatron.core.distributed.wrap_data_parallel`); `bucket_size` (elements)
    replaces --ddp-bucket-size when given (--ddp-num-buckets)."""
    from megatron.core.distributed import wrap_data_parallel

    ddp_config = ddp_config_from_args(args)
    if bucket_size is not None:
        ddp_config = dataclasses.replace(ddp_config, bucket_size=bucket_size)
    wrapped = wrap_data_parallel(model.config, ddp_config, model)
    if args.data_parallel_random_init:
        wrapped.broadcast_params()
    return wrapped


def install_schedule_hooks(model_chunks, optimizer, args):
    """Give the schedules the hooks they read from the model config: hold back DP gradient reduction until
    the last microbatch, finish gradients after the last backward, and scale the loss (fp16)."""
    from megatron.core.distributed import finalize_model_grads

    chunk = model_chunks[0]
    # With several chunks (interleaved pipeline) each has its own no_sync, left before its last backward.
    no_sync = chunk.no_sync if len(model_chunks) == 1 else [each.no_sync for each in model_chunks]
    hooks = {"no_sync_func": no_sync, "finalize_model_grads_func": finalize_model_grads}
    if args.fp16:
        hooks["grad_scale_func"] = optimizer.scale_loss
    # Frozen config: replace it on the outermost wrapper, which is where the schedules look first.
    chunk.config = dataclasses.replace(chunk.config, **hooks)
    return chunk.config


def build_scheduler(optimizer, args):
    """Megatron's scheduler, counted in samples (steps x global batch, or the --*-samples flags) so batch-size
    changes stay exact; lengths from `args.lr_schedule_samples` (set by the training flags' validation)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    lengths = args.lr_schedule_samples
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=lengths.warmup,
        lr_decay_steps=lengths.decay,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=lengths.weight_decay_increment,
        wd_incr_style=args.weight_decay_incr_style,
        wsd_decay_steps=lengths.wsd_decay,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
        use_checkpoint_opt_param_scheduler=getattr(args, "use_checkpoint_opt_param_scheduler", False),
        override_opt_param_scheduler=getattr(args, "override_opt_param_scheduler", False),
    )


def setup_model_and_optimizer(model_provider_func, args):
    """(model chunks, optimizer, scheduler, model config with hooks installed)."""
    from megatron.core.optimizer import get_megatron_optimizer, no_weight_decay_cond_for

    model_chunks = get_model(model_provider_func, args)
    # --embedding-init-method-std also keeps the embeddings out of weight decay (as upstream).
    skip_embeddings = args.embedding_init_method_std is not None
    optimizer = get_megatron_optimizer(
        optimizer_config_from_args(args), model_chunks,
        no_weight_decay_cond=no_weight_decay_cond_for(getattr(args, "no_weight_decay_cond_type", None),
                                                      skip_embeddings),
        default_skip_embedding_weight_decay=skip_embeddings)
    scheduler = build_scheduler(optimizer, args)
    config = install_schedule_hooks(model_chunks, optimizer, args)
    return model_chunks, optimizer, scheduler, config

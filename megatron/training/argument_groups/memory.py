"""Memory flags: the precision-aware optimizer's dtypes, optimizer CPU offload, parameter offload of the FSDP
wrappers and activation offloading."""

from megatron.core.offloading.fine_grained import OFFLOADABLE_MODULES

DTYPE_CHOICES = {
    "main_params_dtype": ["fp32", "fp16"],
    "main_grads_dtype": ["fp32", "bf16"],
    "exp_avg_dtype": ["fp32", "fp16", "bf16", "fp8"],
    "exp_avg_sq_dtype": ["fp32", "fp16", "bf16", "fp8"],
}


def torch_dtype(name):
    """`fp32` / `bf16` / `fp16` -> the torch dtype."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def add_arguments(parser):
    group = parser.add_argument_group("memory")
    group.add_argument(
        "--use-precision-aware-optimizer",
        action="store_true",
        help="Keep the distributed optimizer's main parameters and Adam moments in the dtypes below "
        "(TE's FusedAdam on CUDA where installed, else a torch AdamW that computes in fp32).",
    )
    for dest, choices in DTYPE_CHOICES.items():
        group.add_argument(
            "--" + dest.replace("_", "-"),
            default="fp32",
            choices=choices,
            help=f"Precision-aware optimizer: {dest.replace('_', ' ')} (default fp32).",
        )
    group.add_argument(
        "--optimizer-cpu-offload",
        action="store_true",
        help="Keep the first --optimizer-offload-fraction of the main parameters and their optimizer state in "
        "(pinned) host memory and step them there; needs --use-precision-aware-optimizer. Megatron-FSDP main weights "
        "that are the compute weights themselves (same dtype, e.g. fp32) stay on the device with a stepped host copy.",
    )
    group.add_argument(
        "--optimizer-offload-fraction",
        type=float,
        default=1.0,
        help="Share of the main parameters' elements stepped on the host, whole tensors in order (default 1.0).",
    )
    group.add_argument(
        "--overlap-cpu-optimizer-d2h-h2d",
        action="store_true",
        help="Optimizer CPU offload: copy gradients to the host and parameters back on side streams, one host "
        "optimizer per parameter, overlapped with the device step.",
    )
    group.add_argument(
        "--cpu-offloading",
        action="store_true",
        help="Move the activations of the first --cpu-offloading-num-layers transformer layers to (pinned) host "
        "memory during forward and back for their backward.",
    )
    group.add_argument(
        "--cpu-offloading-num-layers", type=int, default=0,
        help="Transformer layers whose activations --cpu-offloading offloads (0 < N < --num-layers).",
    )
    group.add_argument(
        "--fine-grained-activation-offloading",
        action="store_true",
        help="Move what the --offload-modules pieces of every transformer layer save for backward to (pinned) host "
        "memory during forward and back for their backward.",
    )
    group.add_argument(
        "--offload-modules", nargs="*", choices=OFFLOADABLE_MODULES, default=None,
        help="Fine-grained activation offloading: the pieces of each layer whose saved tensors move to the host.",
    )
    group.add_argument(
        "--min-offloaded-tensor-size", type=int, default=1024 * 1024,
        help="Fine-grained activation offloading: saved tensors of fewer elements stay on the device "
        "(default 1048576).",
    )
    group.add_argument(
        "--use-torch-optimizer-for-cpu-offload",
        action="store_true",
        help="Optimizer CPU offload: step the host part with torch's multi-tensor AdamW (fp32 state) instead of "
        "the precision-aware AdamW.",
    )
    group.add_argument(
        "--megatron-fsdp-param-offload",
        action="store_true",
        help="Megatron-FSDP (optim_grads_params): keep the parameter shards, main weights and gradient shards in "
        "(pinned) host memory; each unit's gather copies its shard to the device and the optimizer steps on the host.",
    )
    group.add_argument(
        "--torch-fsdp2-cpu-offload",
        action="store_true",
        help="FSDP2: keep the sharded parameters and gradients in (pinned) host memory (torch's CPUOffloadPolicy); "
        "each unit's all-gather copies them to the device and the optimizer steps on the host.",
    )


def _validate_cpu_offload(args):
    if not args.optimizer_cpu_offload:
        for flag, set_ in (("--overlap-cpu-optimizer-d2h-h2d", args.overlap_cpu_optimizer_d2h_h2d),
                           ("--use-torch-optimizer-for-cpu-offload", args.use_torch_optimizer_for_cpu_offload),
                           ("--optimizer-offload-fraction", args.optimizer_offload_fraction != 1.0)):
            if set_:
                raise ValueError(f"{flag} needs --optimizer-cpu-offload; pass it or drop {flag}")
        return
    if getattr(args, "use_torch_fsdp2", False):
        raise ValueError("--optimizer-cpu-offload does not work with --use-torch-fsdp2 (it needs "
                         "--use-distributed-optimizer or --use-megatron-fsdp, which FSDP2 excludes): use "
                         "--torch-fsdp2-cpu-offload to keep FSDP2's shards and optimizer state in host memory")
    if not args.use_precision_aware_optimizer:
        # Upstream's rule: the hybrid optimizer reuses the precision-aware optimizer's code path.
        raise ValueError("--optimizer-cpu-offload needs --use-precision-aware-optimizer (with "
                         "--use-distributed-optimizer or --use-megatron-fsdp)")
    if not 0.0 <= args.optimizer_offload_fraction <= 1.0:
        raise ValueError(f"--optimizer-offload-fraction must lie in [0, 1], got {args.optimizer_offload_fraction}")
    if args.use_torch_optimizer_for_cpu_offload:
        for dest in DTYPE_CHOICES:
            if dest != "main_grads_dtype" and getattr(args, dest) != "fp32":
                raise ValueError(f"--use-torch-optimizer-for-cpu-offload keeps fp32 state; drop "
                                 f"--{dest.replace('_', '-')} or that flag")


def _validate_parameter_offload(args):
    if getattr(args, "megatron_fsdp_param_offload", False):
        if not getattr(args, "use_megatron_fsdp", False) or args.data_parallel_sharding_strategy != "optim_grads_params":
            raise ValueError("--megatron-fsdp-param-offload offloads ZeRO-3's shards: it needs --use-megatron-fsdp "
                             "with --data-parallel-sharding-strategy optim_grads_params")
        for flag, set_ in (("--optimizer-cpu-offload", args.optimizer_cpu_offload),
                           ("--fp16", getattr(args, "fp16", False)),
                           ("--fp8-param-gather", getattr(args, "fp8_param_gather", False)),
                           ("--num-distributed-optimizer-instances > 1",
                            getattr(args, "num_distributed_optimizer_instances", 1) > 1)):
            if set_:
                raise ValueError(f"--megatron-fsdp-param-offload does not work with {flag} (the main weights and "
                                 f"gradients already rest on the host, and the step's loss scaling, FP8 gathers and "
                                 f"outer reductions run on the device); drop one of them")
    if getattr(args, "torch_fsdp2_cpu_offload", False) and not getattr(args, "use_torch_fsdp2", False):
        raise ValueError("--torch-fsdp2-cpu-offload offloads FSDP2's shards: it needs --use-torch-fsdp2")


def validate(args):
    _validate_cpu_offload(args)
    _validate_parameter_offload(args)
    changed = [dest for dest in DTYPE_CHOICES if getattr(args, dest) != "fp32"]
    if changed and not args.use_precision_aware_optimizer:
        flags = ", ".join("--" + dest.replace("_", "-") for dest in changed)
        raise ValueError(f"{flags} needs --use-precision-aware-optimizer; pass it or drop {flags}")
    if not args.use_precision_aware_optimizer:
        return
    if args.optimizer != "adam":
        raise ValueError("--use-precision-aware-optimizer steps Adam only: use --optimizer adam")
    if getattr(args, "use_torch_fsdp2", False):
        # FSDP2 excludes the distributed optimizer, so pointing at it would only lead to the next error.
        raise ValueError("--use-precision-aware-optimizer does not work with --use-torch-fsdp2 (it needs "
                         "--use-distributed-optimizer or --use-megatron-fsdp, which FSDP2 excludes): drop it")
    if not (args.use_distributed_optimizer or args.use_megatron_fsdp):
        raise ValueError(
            "--use-precision-aware-optimizer needs the distributed optimizer: pass --use-distributed-optimizer "
            "(or --use-megatron-fsdp)"
        )
    for dest in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(args, dest) == "fp8":
            raise ValueError(
                f"--{dest.replace('_', '-')} fp8 needs Transformer Engine's FusedAdam (CUDA), which this build does "
                "not use; choose bf16 or fp16"
            )
    if args.use_megatron_fsdp:
        for dest, flag in (("main_params_dtype", "--megatron-fsdp-main-params-dtype"),
                           ("main_grads_dtype", "--megatron-fsdp-main-grads-dtype")):
            if getattr(args, dest) != "fp32":
                raise ValueError(
                    f"--{dest.replace('_', '-')} is for the distributed optimizer; with --use-megatron-fsdp use {flag}"
                )
    if args.main_grads_dtype == "bf16":
        if not args.bf16:
            raise ValueError("--main-grads-dtype bf16 needs --bf16 (the gradient buffers take the model's dtype)")
        if args.accumulate_allreduce_grads_in_fp32:
            raise ValueError("--main-grads-dtype bf16 and --accumulate-allreduce-grads-in-fp32 are exclusive")
        # bf16 gradient buffers: upstream's fp32 default for --bf16 is opted out of.
        args.grad_reduce_in_bf16 = True


def optimizer_config_kwargs(args):
    """The precision-aware and CPU-offload fields of OptimizerConfig."""
    kwargs = {dest: torch_dtype(getattr(args, dest)) for dest in DTYPE_CHOICES}
    return dict(use_precision_aware_optimizer=args.use_precision_aware_optimizer,
                optimizer_cpu_offload=args.optimizer_cpu_offload,
                optimizer_offload_fraction=args.optimizer_offload_fraction,
                overlap_cpu_optimizer_d2h_h2d=args.overlap_cpu_optimizer_d2h_h2d,
                use_torch_optimizer_for_cpu_offload=args.use_torch_optimizer_for_cpu_offload, **kwargs)


def ddp_config_kwargs(args):
    """The parameter-offload fields of DistributedDataParallelConfig."""
    return dict(torch_fsdp2_cpu_offload=getattr(args, "torch_fsdp2_cpu_offload", False),
                megatron_fsdp_param_offload=getattr(args, "megatron_fsdp_param_offload", False))


def transformer_config_kwargs(args):
    """The activation-offloading fields of TransformerConfig (it checks them against the model's shape)."""
    return dict(cpu_offloading=args.cpu_offloading, cpu_offloading_num_layers=args.cpu_offloading_num_layers,
                fine_grained_activation_offloading=args.fine_grained_activation_offloading,
                offload_modules=tuple(args.offload_modules or ()),
                min_offloaded_tensor_size=args.min_offloaded_tensor_size)

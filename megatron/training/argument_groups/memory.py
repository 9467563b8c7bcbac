"""Memory flags: the precision-aware optimizer's dtypes."""

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


def validate(args):
    changed = [dest for dest in DTYPE_CHOICES if getattr(args, dest) != "fp32"]
    if changed and not args.use_precision_aware_optimizer:
        flags = ", ".join("--" + dest.replace("_", "-") for dest in changed)
        raise ValueError(f"{flags} needs --use-precision-aware-optimizer; pass it or drop {flags}")
    if not args.use_precision_aware_optimizer:
        return
    if args.optimizer != "adam":
        raise ValueError("--use-precision-aware-optimizer steps Adam only: use --optimizer adam")
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
    """The precision-aware fields of OptimizerConfig."""
    kwargs = {dest: torch_dtype(getattr(args, dest)) for dest in DTYPE_CHOICES}
    return dict(use_precision_aware_optimizer=args.use_precision_aware_optimizer, **kwargs)

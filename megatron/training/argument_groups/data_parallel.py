"""Data-parallel flags: DDP, the distributed optimizer, Megatron-FSDP and PyTorch FSDP2."""

import argparse
import os
import warnings

from megatron.training.argument_groups import nccl_buffers

SHARDING_STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
DEFAULT_SHARDING_STRATEGY = "optim_grads_params"
MEGATRON_FSDP_DTYPE_CHOICES = ["fp32", "bf16", "fp16", "auto"]


def megatron_fsdp_dtype(choice):
    """`--megatron-fsdp-*-dtype` value -> torch dtype, or None for "auto" (see DistributedDataParallelConfig)."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "auto": None}[choice]


class _UseCustomFsdp(argparse.Action):
    """`--use-custom-fsdp`: sets `use_megatron_fsdp` while parsing, so that every argument group's rules (the
    precision-aware optimizer's, the checkpoint format's, ...) treat it as --use-megatron-fsdp."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.use_megatron_fsdp = True
        setattr(namespace, self.dest, True)


class _StoreMegatronFsdpSetting(argparse.Action):
    """Stores a Megatron-FSDP setting and records that it was given, so that one spelled at its default value
    without --use-megatron-fsdp is reported like any other value (see `_warn_megatron_fsdp_only_flags`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.megatron_fsdp_settings_given = sorted({*namespace.megatron_fsdp_settings_given, self.dest})


def add_arguments(parser):
    nccl_buffers.add_arguments(parser)
    group = parser.add_argument_group("data parallel")
    parser.set_defaults(megatron_fsdp_settings_given=())
    group.add_argument("--use-distributed-optimizer", action="store_true", help="ZeRO-1 for the DDP path.")
    group.add_argument("--overlap-grad-reduce", action="store_true", help="Overlap grad reduction with backward.")
    group.add_argument("--overlap-param-gather", action="store_true", help="Overlap param gather with forward.")
    group.add_argument("--ddp-bucket-size", type=int, default=None, help="Elements per gradient bucket.")
    group.add_argument(
        "--ddp-average-in-collective", action="store_true", help="Average in the collective instead of pre-scaling."
    )
    group.add_argument(
        "--accumulate-allreduce-grads-in-fp32",
        action="store_true",
        help="fp32 gradient buffers and reductions with bf16/fp16 parameters (always on with --bf16 unless "
        "--grad-reduce-in-bf16).",
    )
    group.add_argument(
        "--grad-reduce-in-bf16",
        action="store_true",
        help="With --bf16: accumulate and reduce gradients in bf16 instead of upstream's fp32 default (Megatron DDP, "
        "the distributed optimizer, FSDP2 and Megatron-FSDP).",
    )
    group.add_argument(
        "--no-gradient-accumulation-fusion",
        action="store_false",
        dest="gradient_accumulation_fusion",
        help="Turn off the fused weight-gradient accumulation.",
    )
    group.add_argument(
        "--data-parallel-random-init", action="store_true", help="Different initial weights per data-parallel rank."
    )
    group.add_argument("--use-megatron-fsdp", action="store_true", help="Wrap the model with Megatron-FSDP.")
    group.add_argument("--use-custom-fsdp", action=_UseCustomFsdp, dest="use_custom_fsdp_deprecated",
                       help="Deprecated: upstream's earlier name of --use-megatron-fsdp; the same.")
    group.add_argument(
        "--data-parallel-sharding-strategy",
        action=_StoreMegatronFsdpSetting,
        default=DEFAULT_SHARDING_STRATEGY,
        choices=SHARDING_STRATEGIES,
        help="ZeRO level under Megatron-FSDP.",
    )
    group.add_argument(
        "--outer-dp-sharding-strategy",
        action=_StoreMegatronFsdpSetting,
        default="no_shard",
        choices=["no_shard", "optim"],
        help="Across the outer data-parallel dimension: replicate (HSDP) or shard optimizer state (HFSDP).",
    )
    group.add_argument(
        "--num-distributed-optimizer-instances",
        type=int,
        default=1,
        help="N>1: hybrid sharding, N replicas each sharded over DP/N ranks.",
    )
    group.add_argument(
        "--init-model-with-meta-device", action="store_true", help="Build on meta, materialise shard by shard."
    )
    group.add_argument("--fsdp-double-buffer", action="store_true", help="Two unit-sized gather buffers.")
    group.add_argument(
        "--megatron-fsdp-main-params-dtype",
        action=_StoreMegatronFsdpSetting,
        default="fp32",
        choices=MEGATRON_FSDP_DTYPE_CHOICES,
        help="Megatron-FSDP main weights (what the optimizer steps on); auto: the parameters' dtype.",
    )
    group.add_argument(
        "--megatron-fsdp-main-grads-dtype",
        action=_StoreMegatronFsdpSetting,
        default="auto",
        choices=MEGATRON_FSDP_DTYPE_CHOICES,
        help="Megatron-FSDP gradient accumulation and optimizer-gradient dtype; auto: fp32 with "
        "--accumulate-allreduce-grads-in-fp32 (on under --bf16 unless --grad-reduce-in-bf16; an explicit "
        "--megatron-fsdp-grad-comm-dtype under --bf16 keeps fp32 here), otherwise the parameters' dtype, as "
        "Megatron DDP keeps its gradients.",
    )
    group.add_argument(
        "--megatron-fsdp-grad-comm-dtype",
        action=_StoreMegatronFsdpSetting,
        default="auto",
        choices=MEGATRON_FSDP_DTYPE_CHOICES,
        help="Megatron-FSDP gradient reduction dtype; auto: the main grads dtype.",
    )
    group.add_argument(
        "--use-torch-fsdp2",
        action="store_true",
        help="PyTorch FSDP2 (fully_shard on each transformer layer, the embedding and the rest) instead of DDP; "
        "works with tensor, sequence and pipeline parallelism.",
    )
    group.add_argument(
        "--torch-fsdp2-no-reshard-after-forward",
        "--no-torch-fsdp2-reshard-after-forward",
        action="store_false",
        dest="torch_fsdp2_reshard_after_forward",
        help="Keep FSDP2 parameters gathered between forward and backward.",
    )
    group.add_argument(
        "--torch-fsdp2-reshard-after-forward",
        action="store_true",
        dest="torch_fsdp2_reshard_after_forward",
        help="Free FSDP2's gathered parameters after each layer's forward and regather them for backward (the "
        "default; the last of the two spellings given wins).",
    )


def _cuda_visible():
    from megatron.training.accelerator import cuda_available

    return cuda_available()


def _reject_contradicting_megatron_fsdp_dtypes(args):
    """An explicit --megatron-fsdp-*-dtype that contradicts --grad-reduce-in-bf16 or an explicit
    --accumulate-allreduce-grads-in-fp32 (one of them would be silently dropped)."""
    comm, main_grads = args.megatron_fsdp_grad_comm_dtype, args.megatron_fsdp_main_grads_dtype
    if args.grad_reduce_in_bf16 and comm not in ("auto", "bf16"):
        raise ValueError(f"--grad-reduce-in-bf16 and --megatron-fsdp-grad-comm-dtype {comm} contradict each other: "
                         "drop one")
    if args.accumulate_allreduce_grads_in_fp32:
        for flag, value in (("--megatron-fsdp-main-grads-dtype", main_grads),
                            ("--megatron-fsdp-grad-comm-dtype", comm)):
            if value in ("bf16", "fp16"):
                raise ValueError(f"--accumulate-allreduce-grads-in-fp32 and {flag} {value} contradict each other: "
                                 "drop one")


def _validate_gradient_precision(args):
    """Upstream's bf16 rule: gradients accumulate and are reduced in fp32 unless --grad-reduce-in-bf16."""
    if args.use_megatron_fsdp:
        _reject_contradicting_megatron_fsdp_dtypes(args)
    if args.grad_reduce_in_bf16:
        if not args.bf16:
            raise ValueError("--grad-reduce-in-bf16 needs --bf16 (fp32 models reduce in fp32); drop it")
        if args.accumulate_allreduce_grads_in_fp32:
            raise ValueError(
                "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 are exclusive: pick one"
            )
        if args.use_megatron_fsdp and args.megatron_fsdp_grad_comm_dtype == "auto":
            args.megatron_fsdp_grad_comm_dtype = "bf16"
        return
    explicit_half_comm = args.use_megatron_fsdp and args.megatron_fsdp_grad_comm_dtype in ("bf16", "fp16")
    if args.bf16 and not explicit_half_comm:
        args.accumulate_allreduce_grads_in_fp32 = True
    elif args.bf16 and args.megatron_fsdp_main_grads_dtype == "auto":
        # The explicit dtype changes the reduction only (fp32 reduction would contradict it): gradients still
        # accumulate in fp32, as under --bf16 without it.
        args.megatron_fsdp_main_grads_dtype = "fp32"


def _check_weight_hash_has_replicas(args):
    """--check-weight-hash-across-dp-replicas-interval compares the data-parallel replicas of each weight; a
    wrapper that shards the weights over every data-parallel rank has none (each gathered weight is the same bytes
    on every rank by construction), so the check cannot fail: a warning says so (upstream's Megatron-FSDP recipe
    passes the flag, so it is not refused)."""
    if getattr(args, "check_weight_hash_across_dp_replicas_interval", None) is None:
        return
    if args.data_parallel_size * args.context_parallel_size == 1:
        return
    zero3 = args.use_megatron_fsdp and args.data_parallel_sharding_strategy == "optim_grads_params"
    if zero3 and args.num_distributed_optimizer_instances == 1:
        wrapper = "--use-megatron-fsdp with --data-parallel-sharding-strategy optim_grads_params"
    elif args.use_torch_fsdp2:
        wrapper = "--use-torch-fsdp2"
    else:
        return
    warnings.warn(f"--check-weight-hash-across-dp-replicas-interval compares the data-parallel replicas of each "
                  f"weight, but {wrapper} shards every weight over the data-parallel ranks: there are no replicas to "
                  "compare and the check always passes. Shard less (another --data-parallel-sharding-strategy, or "
                  "HSDP with --num-distributed-optimizer-instances > 1, whose replicas it compares) or drop the flag")


# Megatron-FSDP's own settings: flag, destination, default.
MEGATRON_FSDP_ONLY_FLAGS = (
    ("--data-parallel-sharding-strategy", "data_parallel_sharding_strategy", DEFAULT_SHARDING_STRATEGY),
    ("--outer-dp-sharding-strategy", "outer_dp_sharding_strategy", "no_shard"),
    ("--megatron-fsdp-main-params-dtype", "megatron_fsdp_main_params_dtype", "fp32"),
    ("--megatron-fsdp-main-grads-dtype", "megatron_fsdp_main_grads_dtype", "auto"),
    ("--megatron-fsdp-grad-comm-dtype", "megatron_fsdp_grad_comm_dtype", "auto"),
)


def _warn_megatron_fsdp_only_flags(args):
    """Without --use-megatron-fsdp its settings change nothing (DDP, the distributed optimizer and FSDP2 read
    none of them): say so instead of training with other dtypes or sharding than the command line asks for."""
    given = getattr(args, "megatron_fsdp_settings_given", ())
    for flag, dest, default in MEGATRON_FSDP_ONLY_FLAGS:
        value = getattr(args, dest)
        if value != default or dest in given:
            warnings.warn(f"{flag} {value} has no effect without --use-megatron-fsdp (it is a Megatron-FSDP "
                          "setting); add --use-megatron-fsdp to train that way, or drop the flag")


def _warn_settings_fsdp2_does_not_read(args):
    """FSDP2 reduce-scatters each fully_shard module's gradients on its own and chooses how to average them."""
    if args.ddp_bucket_size is not None:
        warnings.warn("--ddp-bucket-size has no effect with --use-torch-fsdp2 (it communicates per layer, without "
                      "gradient buckets); drop the flag")
    if args.ddp_average_in_collective:
        warnings.warn("--ddp-average-in-collective has no effect with --use-torch-fsdp2 (FSDP2 averages the "
                      "gradients in its own way, with the same result); drop the flag")


def validate(args):
    if getattr(args, "use_custom_fsdp_deprecated", False):
        if getattr(args, "rank", 0) == 0:
            print("WARNING: --use-custom-fsdp is deprecated; use --use-megatron-fsdp (the same)", flush=True)
    _validate_gradient_precision(args)
    nccl_buffers.validate(args)
    if args.use_megatron_fsdp and args.use_torch_fsdp2:
        raise ValueError("--use-megatron-fsdp and --use-torch-fsdp2 are exclusive: pick one")
    if args.use_megatron_fsdp:
        # Megatron-FSDP shards optimizer state itself and always overlaps its communication.
        args.use_distributed_optimizer = True
        args.overlap_grad_reduce = True
        args.overlap_param_gather = True
        if args.init_model_with_meta_device and args.data_parallel_sharding_strategy == "no_shard":
            raise ValueError(
                "--init-model-with-meta-device needs a sharded --data-parallel-sharding-strategy "
                "(optim, optim_grads or optim_grads_params), not no_shard"
            )
        if args.outer_dp_sharding_strategy == "optim":
            if args.data_parallel_sharding_strategy != "optim_grads_params":
                raise ValueError(
                    "--outer-dp-sharding-strategy optim needs --data-parallel-sharding-strategy optim_grads_params"
                )
            if args.num_distributed_optimizer_instances < 2:
                raise ValueError("--outer-dp-sharding-strategy optim needs --num-distributed-optimizer-instances > 1")
        if _cuda_visible() and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
            raise ValueError(
                "--use-megatron-fsdp must not run with CUDA_DEVICE_MAX_CONNECTIONS=1 (it serialises "
                "communication with compute); unset it"
            )
        if args.fsdp_double_buffer and args.data_parallel_sharding_strategy != "optim_grads_params":
            raise ValueError("--fsdp-double-buffer needs --data-parallel-sharding-strategy optim_grads_params")
    elif args.fsdp_double_buffer:
        raise ValueError("--fsdp-double-buffer needs --use-megatron-fsdp")
    elif args.init_model_with_meta_device:
        # FSDP2 here shards a materialised model; only Megatron-FSDP materialises a meta model shard by shard.
        raise ValueError("--init-model-with-meta-device needs --use-megatron-fsdp")
    if not args.use_megatron_fsdp:
        _warn_megatron_fsdp_only_flags(args)
    if not args.use_torch_fsdp2 and not args.torch_fsdp2_reshard_after_forward:
        warnings.warn("--torch-fsdp2-no-reshard-after-forward has no effect without --use-torch-fsdp2; add "
                      "--use-torch-fsdp2 to train that way, or drop the flag")
    if args.use_torch_fsdp2:
        _warn_settings_fsdp2_does_not_read(args)
        if args.ckpt_format not in ("torch_dist", "torch_dcp"):
            raise ValueError("--use-torch-fsdp2 needs --ckpt-format torch_dist or torch_dcp")
        if not args.untie_embeddings_and_output_weights:
            raise ValueError("--use-torch-fsdp2 needs --untie-embeddings-and-output-weights")
        if args.fp16:
            raise ValueError("--use-torch-fsdp2 does not support --fp16; use --bf16")
        if args.use_distributed_optimizer:
            raise ValueError("--use-torch-fsdp2 and --use-distributed-optimizer are exclusive")
    if args.overlap_param_gather:
        if args.use_torch_fsdp2:
            # FSDP2 excludes the distributed optimizer, so pointing at it would only lead to the next error.
            raise ValueError("--overlap-param-gather does not work with --use-torch-fsdp2 (it needs "
                             "--use-distributed-optimizer or --use-megatron-fsdp, which FSDP2 excludes; FSDP2 "
                             "already gathers each unit's parameters ahead of its use): drop it")
        if not args.overlap_grad_reduce:
            raise ValueError("--overlap-param-gather needs --overlap-grad-reduce")
        if not (args.use_distributed_optimizer or args.use_megatron_fsdp):
            raise ValueError("--overlap-param-gather needs --use-distributed-optimizer or --use-megatron-fsdp")
    instances = args.num_distributed_optimizer_instances
    if instances < 1:
        raise ValueError(f"--num-distributed-optimizer-instances must be >= 1, got {instances}")
    if instances > 1:
        if not (args.use_distributed_optimizer or args.use_megatron_fsdp):
            raise ValueError(
                "--num-distributed-optimizer-instances > 1 needs --use-distributed-optimizer or --use-megatron-fsdp"
            )
        data_and_context_parallel = args.data_parallel_size * args.context_parallel_size
        if data_and_context_parallel % instances != 0:
            raise ValueError(
                f"data-parallel x --context-parallel-size ({data_and_context_parallel}) must be divisible by "
                f"--num-distributed-optimizer-instances ({instances})"
            )
    _check_weight_hash_has_replicas(args)
    if args.calculate_per_token_loss and args.ddp_average_in_collective:
        from megatron.core.distributed.data_parallel_base import PER_TOKEN_AVERAGE_MESSAGE

        raise ValueError(PER_TOKEN_AVERAGE_MESSAGE)
    if args.ddp_bucket_size is not None and args.ddp_bucket_size <= 0:
        raise ValueError(f"--ddp-bucket-size must be positive, got {args.ddp_bucket_size}")

"""Profiling flags: a PyTorch profiler trace or an Nsight Systems capture range over chosen iterations, and the
CUDA caching allocator's history (see megatron/training/profiling.py)."""

from megatron.training import accelerator


def add_arguments(parser):
    group = parser.add_argument_group("profiling")
    group.add_argument(
        "--profile",
        action="store_true",
        help="Profile the iterations from --profile-step-start to --profile-step-end on --profile-ranks: with "
        "--use-pytorch-profiler a torch.profiler trace; without it (GPU only) torch.cuda.profiler start/stop, the "
        "capture range of `nsys profile --capture-range=cudaProfilerApi`.",
    )
    group.add_argument(
        "--use-pytorch-profiler",
        action="store_true",
        help="With --profile: record with torch.profiler (CPU and GPU) and write a Chrome/TensorBoard trace, "
        "<rank>.<time>.pt.trace.json, to --tensorboard-dir (else --save).",
    )
    group.add_argument(
        "--profile-step-start",
        type=int,
        default=10,
        help="Completed iterations before profiling starts, as upstream counts them: the default 10 and 12 profile "
        "the steps the log numbers 11 and 12.",
    )
    group.add_argument(
        "--profile-step-end", type=int, default=12, help="Completed iterations when profiling stops (see above)."
    )
    group.add_argument(
        "--profile-ranks", type=int, nargs="+", default=[0], help="Global ranks that profile (default: 0)."
    )
    group.add_argument(
        "--record-memory-history",
        action="store_true",
        help="Record the CUDA caching allocator's history (with stack traces) and dump a snapshot at every "
        "--log-interval on the last rank, for https://pytorch.org/memory_viz (GPU only).",
    )
    group.add_argument(
        "--memory-snapshot-path",
        default="snapshot.pickle",
        help="Where --record-memory-history writes its snapshot (default snapshot.pickle).",
    )


def _backend(args):
    return args.distributed_backend or accelerator.default_backend()


def validate(args):
    if args.use_pytorch_profiler and not args.profile:
        raise ValueError("--use-pytorch-profiler chooses the profiler of --profile: add --profile (or drop "
                         "--use-pytorch-profiler)")
    if args.profile:
        if args.profile_step_start < 0:
            raise ValueError(f"--profile-step-start must be >= 0, got {args.profile_step_start}")
        if args.profile_step_end <= args.profile_step_start:
            raise ValueError(f"--profile-step-end ({args.profile_step_end}) must be greater than --profile-step-start "
                             f"({args.profile_step_start})")
        bad_ranks = [rank for rank in args.profile_ranks if not 0 <= rank < args.world_size]
        if bad_ranks:
            raise ValueError(f"--profile-ranks {bad_ranks} are not ranks of this run (world size {args.world_size})")
        if args.use_pytorch_profiler:
            if not (args.tensorboard_dir or args.save):
                raise ValueError("--use-pytorch-profiler writes its trace to --tensorboard-dir (or --save): give "
                                 "one of them")
        elif _backend(args) != "nccl":
            raise ValueError("--profile without --use-pytorch-profiler marks an Nsight Systems capture range "
                             "(cudaProfilerStart/Stop) and needs CUDA; this run uses "
                             f"{_backend(args)}: add --use-pytorch-profiler for a torch.profiler trace")
    if args.record_memory_history and _backend(args) != "nccl":
        raise ValueError("--record-memory-history records the CUDA caching allocator and needs a CUDA device; "
                         f"this run uses {_backend(args)}: drop --record-memory-history (the memory line of "
                         "--log-memory-to-tensorboard reports CPU memory)")

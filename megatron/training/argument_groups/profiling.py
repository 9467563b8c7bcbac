"""Profiling flags: a PyTorch profiler trace (optionally with shapes, call stacks and a Chakra execution trace) or
an Nsight Systems capture range over chosen iterations, NVTX ranges around the steps' phases and modules, and the
CUDA caching allocator's history (see megatron/training/profiling.py)."""

import warnings

import torch

from megatron.training import accelerator

PYTORCH_PROFILER_COLLECT_FLAGS = (
    ("--pytorch-profiler-collect-shapes", "pytorch_profiler_collect_shapes"),
    ("--pytorch-profiler-collect-callstack", "pytorch_profiler_collect_callstack"),
    ("--pytorch-profiler-collect-chakra", "pytorch_profiler_collect_chakra"),
)


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
        "--pytorch-profiler-collect-shapes",
        action="store_true",
        help="With --use-pytorch-profiler: record the input shapes of every op (torch.profiler's record_shapes).",
    )
    group.add_argument(
        "--pytorch-profiler-collect-callstack",
        action="store_true",
        help="With --use-pytorch-profiler: record the Python call stack of every op (torch.profiler's with_stack).",
    )
    group.add_argument(
        "--pytorch-profiler-collect-chakra",
        action="store_true",
        help="With --use-pytorch-profiler: also write an execution trace of the profiled steps for Chakra "
        "(torch.profiler.ExecutionTraceObserver) to <trace dir>/chakra/rank<R>.json.",
    )
    group.add_argument(
        "--nvtx-ranges",
        action="store_true",
        help="NVTX ranges for Nsight Systems (CUDA): each training step, its forward-backward and optimizer "
        "phases, and the forward of the embedding, every transformer layer, its attention and MLP, and the "
        "output layer. On CPU there is nothing to annotate (a warning says so).",
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
    given_collect_flags = [flag for flag, dest in PYTORCH_PROFILER_COLLECT_FLAGS if getattr(args, dest)]
    if given_collect_flags and not (args.profile and args.use_pytorch_profiler):
        raise ValueError(f"{', '.join(given_collect_flags)} choose what the PyTorch profiler records: add --profile "
                         "--use-pytorch-profiler (or drop them)")
    if args.pytorch_profiler_collect_chakra and not hasattr(torch.profiler, "ExecutionTraceObserver"):
        raise ValueError(f"--pytorch-profiler-collect-chakra needs torch.profiler.ExecutionTraceObserver, which "
                         f"torch {torch.__version__} does not have: drop the flag or upgrade torch")
    if args.nvtx_ranges and _backend(args) != "nccl":
        warnings.warn(f"--nvtx-ranges annotates CUDA work for Nsight Systems; this run uses {_backend(args)} (CPU), "
                      "so no range is recorded: drop the flag, or use --profile --use-pytorch-profiler for a trace")
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

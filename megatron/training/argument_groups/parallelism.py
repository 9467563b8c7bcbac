"""Model-parallel layout flags and the derived data-parallel size."""

import os
import warnings


def add_arguments(parser):
    group = parser.add_argument_group("parallelism")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1, help="Tensor-parallel degree.")
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="Pipeline-parallel degree.")
    group.add_argument("--context-parallel-size", type=int, default=1, help="Context-parallel degree.")
    group.add_argument(
        "--sequence-parallel", action="store_true", help="Shard norm/dropout activations along the sequence (TP>1)."
    )
    group.add_argument(
        "--distributed-backend",
        default=None,
        choices=["nccl", "gloo"],
        help="Process-group backend; default nccl when a GPU is visible, else gloo.",
    )
    group.add_argument("--distributed-timeout-minutes", type=int, default=10, help="Collective timeout.")
    group.add_argument("--local-rank", type=int, default=None, help="Set by the launcher (LOCAL_RANK is preferred).")


def validate(args):
    args.rank = int(os.environ.get("RANK", "0"))
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    for flag, value in (
        ("--tensor-model-parallel-size", args.tensor_model_parallel_size),
        ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size),
        ("--context-parallel-size", args.context_parallel_size),
    ):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    model_parallel_size = (
        args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    )
    if args.world_size % model_parallel_size != 0:
        raise ValueError(
            f"world size ({args.world_size}) must be divisible by --tensor-model-parallel-size "
            f"({args.tensor_model_parallel_size}) x --pipeline-model-parallel-size "
            f"({args.pipeline_model_parallel_size}) x --context-parallel-size ({args.context_parallel_size})"
        )
    args.data_parallel_size = args.world_size // model_parallel_size
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        warnings.warn("--sequence-parallel has no effect with --tensor-model-parallel-size 1; turning it off")
        args.sequence_parallel = False
    if args.context_parallel_size > 1:
        raise ValueError("not implemented yet: --context-parallel-size > 1")

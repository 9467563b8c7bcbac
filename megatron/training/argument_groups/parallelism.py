"""Model-parallel layout flags and the derived data-parallel size."""

import os
import warnings


def add_arguments(parser):
    group = parser.add_argument_group("parallelism")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1, help="Tensor-parallel degree.")
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="Pipeline-parallel degree.")
    group.add_argument(
        "--context-parallel-size", type=int, default=1,
        help="Context-parallel degree: each rank holds 1/N of every sequence (two load-balanced chunks).",
    )
    group.add_argument(
        "--cp-comm-type", nargs="+", default=["p2p"],
        help="Attention communication under context parallelism: p2p (K/V ring), allgather (or all_gather) or a2a "
        "(Ulysses all-to-all over heads). Upstream also takes one value per layer; here a single value applies "
        "to every layer.",
    )
    group.add_argument(
        "--hierarchical-context-parallel-sizes", type=int, nargs="+", default=None,
        help="Upstream's a2a+p2p layout; not supported here (a clear error): use one --cp-comm-type.",
    )
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
    _validate_context_parallel(args)


def _validate_context_parallel(args):
    from megatron.core.transformer.context_parallel import normalize_cp_comm_type

    comm_types = {normalize_cp_comm_type(value) for value in args.cp_comm_type}
    if len(comm_types) != 1:
        raise ValueError(
            f"--cp-comm-type takes one value for every layer here, got {args.cp_comm_type}; per-layer comm types "
            "are not supported"
        )
    args.cp_comm_type = comm_types.pop()
    if args.hierarchical_context_parallel_sizes is not None:
        raise ValueError(
            "--hierarchical-context-parallel-sizes (upstream's a2a+p2p) is not supported; drop it and pick a "
            "single --cp-comm-type (p2p, allgather or a2a)"
        )
    cp = args.context_parallel_size
    if cp == 1:
        return
    divisor = 2 * cp * (args.tensor_model_parallel_size if args.sequence_parallel else 1)
    if args.seq_length is not None and args.seq_length % divisor != 0:
        with_sp = (f" x --tensor-model-parallel-size ({args.tensor_model_parallel_size}) with --sequence-parallel"
                   if args.sequence_parallel else "")
        raise ValueError(
            f"--seq-length ({args.seq_length}) must be divisible by 2 x --context-parallel-size ({cp}){with_sp} "
            f"= {divisor}: each context-parallel rank holds two of 2 x CP equal chunks"
        )
    if args.cp_comm_type == "a2a":
        tp = args.tensor_model_parallel_size
        heads = args.num_attention_heads
        groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
        if heads is not None and groups is not None and ((heads // tp) % cp or (groups // tp) % cp):
            raise ValueError(
                f"--cp-comm-type a2a splits the heads of each tensor-parallel rank over --context-parallel-size "
                f"({cp}): --num-attention-heads ({heads}) and --num-query-groups ({groups}) divided by "
                f"--tensor-model-parallel-size ({tp}) must be divisible by it; use --cp-comm-type p2p or allgather"
            )

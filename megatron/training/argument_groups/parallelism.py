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
        help="Attention communication under context parallelism: p2p (K/V ring), allgather (or all_gather), a2a "
        "(Ulysses all-to-all over heads) or a2a+p2p (all-to-all inside the inner groups of "
        "--hierarchical-context-parallel-sizes, p2p ring across the outer ones). One value for every layer, or "
        "one per layer (--num-layers values).",
    )
    group.add_argument(
        "--hierarchical-context-parallel-sizes", type=int, nargs="+", default=None,
        help="Inner and outer degrees of a2a+p2p context parallelism: e.g. 2 4 is a 2-way all-to-all inside and a "
        "4-way p2p ring across; the product must equal --context-parallel-size.",
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
    group.add_argument("--distributed-timeout-minutes", type=int, default=10,
                       help="Timeout of the collectives of every process group (default and model-parallel).")
    group.add_argument("--local-rank", "--local_rank", type=int, default=None,
                       help="This process's rank on its node, as the launcher passes it; default: the environment's "
                       "LOCAL_RANK (0 without one). The flag wins over the variable, as upstream; --local_rank is the "
                       "older launchers' spelling.")


def validate(args):
    args.rank, args.world_size = launch_rank_and_world_size(args)
    if args.local_rank is None:
        args.local_rank = _environment_int("LOCAL_RANK", 0)
    elif args.local_rank < 0:
        raise ValueError(f"--local-rank must be >= 0 (this process's device on its node), got {args.local_rank}: drop "
                         "it to take the launcher's LOCAL_RANK")
    if args.distributed_timeout_minutes < 1:
        raise ValueError(f"--distributed-timeout-minutes must be at least 1, got {args.distributed_timeout_minutes}: "
                         "it is how long a collective may wait for the other ranks")
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


def launch_rank_and_world_size(args):
    """(rank, world size) of this process: those `initialize_megatron()` took from a process group that already
    existed (args.rank / args.world_size set), else the launcher's RANK / WORLD_SIZE (0 / 1 without one)."""
    if getattr(args, "rank", None) is not None and getattr(args, "world_size", None) is not None:
        return args.rank, args.world_size
    rank, world_size = _environment_int("RANK", 0), _environment_int("WORLD_SIZE", 1)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"the launcher's environment gives this process RANK={os.environ.get('RANK', '(unset)')} and "
            f"WORLD_SIZE={os.environ.get('WORLD_SIZE', '(unset)')}: RANK must be in 0 .. WORLD_SIZE - 1. Launch the "
            "ranks with torchrun (torchrun --nproc-per-node N pretrain_gpt.py ...), which sets both, or unset "
            "them to run one rank with plain python"
        )
    return rank, world_size


def _environment_int(name, default):
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"the environment variable {name}={text!r} must be an integer (torchrun sets it)") from None


def _validate_context_parallel(args):
    from megatron.core.transformer.context_parallel.comm_types import (
        HIERARCHICAL_COMM_TYPE,
        comm_types_in_use,
        heads_split_size,
        normalize_cp_comm_types,
        validate_hierarchical_sizes,
    )

    comm_type = normalize_cp_comm_types(args.cp_comm_type, args.num_layers)
    args.cp_comm_type = comm_type if isinstance(comm_type, str) else list(comm_type)
    cp = args.context_parallel_size
    if cp == 1 and HIERARCHICAL_COMM_TYPE in comm_types_in_use(comm_type) and \
            args.hierarchical_context_parallel_sizes is None:
        # As Megatron-LM: a2a+p2p always needs the sizes, also where one context-parallel rank makes it a no-op.
        raise ValueError(
            "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes INNER OUTER with INNER x OUTER = "
            "--context-parallel-size; at --context-parallel-size 1 that is --hierarchical-context-parallel-sizes "
            "1 1, or use --cp-comm-type p2p (the default): with one context-parallel rank no comm type communicates"
        )
    sizes = validate_hierarchical_sizes(args.hierarchical_context_parallel_sizes, cp, comm_type)
    args.hierarchical_context_parallel_sizes = None if sizes is None else list(sizes)
    tp, seq_length = args.tensor_model_parallel_size, args.seq_length
    if cp > 1 and seq_length is not None and seq_length % (2 * cp) != 0:
        raise ValueError(
            f"--seq-length ({seq_length}) must be divisible by 2 x --context-parallel-size ({cp}) = {2 * cp}: each "
            "context-parallel rank holds two of 2 x CP equal chunks; change --seq-length"
        )
    # As upstream: sequence parallelism splits each context-parallel rank's tokens (its two chunks together), so
    # only their count, not each chunk, must divide by the tensor-parallel size.
    if args.sequence_parallel and seq_length is not None and (seq_length // cp) % tp != 0:
        per_rank = (f" / --context-parallel-size ({cp}) = {seq_length // cp} tokens per context-parallel rank"
                    if cp > 1 else "")
        raise ValueError(
            f"--seq-length ({seq_length}){per_rank} must be divisible by --tensor-model-parallel-size ({tp}) with "
            "--sequence-parallel: each tensor-parallel rank holds an equal slice of the sequence; change "
            "--seq-length or drop --sequence-parallel"
        )
    if cp == 1:
        return
    heads = args.num_attention_heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    for name in sorted(comm_types_in_use(comm_type)):
        split = heads_split_size(name, cp, sizes)
        if split > 1 and heads is not None and groups is not None and ((heads // tp) % split or (groups // tp) % split):
            over = (f"--context-parallel-size ({cp})" if name == "a2a"
                    else f"the inner --hierarchical-context-parallel-sizes ({split})")
            raise ValueError(
                f"--cp-comm-type {name} splits the heads of each tensor-parallel rank over {over}: "
                f"--num-attention-heads ({heads}) and --num-query-groups ({groups}) divided by "
                f"--tensor-model-parallel-size ({tp}) must be divisible by it; use --cp-comm-type p2p or allgather"
            )

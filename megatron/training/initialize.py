"""Process start-up: arguments, the default process group, model-parallel groups, threads and seeds."""

import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron.core.num_microbatches_calculator import (
    destroy_num_microbatches_calculator,
    init_num_microbatches_calculator,
)
from megatron.core.rank_layout import DEFAULT_ORDER
from megatron.core.timers import Timers
from megatron.training import accelerator
from megatron.training.arguments import parse_args, validate_args
from megatron.training.global_state import get_tokenizer, set_args, set_timers, set_tokenizer
from megatron.training.result_validation import setup_rerun_state_machine
from megatron.training.run_control import setup_logging
from megatron.training.signal_handler import install_exit_signal_handler, uninstall_exit_signal_handler


def initialize_megatron(extra_args_provider=None, args_defaults=None, ignore_unknown_args=False, args=None, *,
                        allow_no_cuda=False, skip_mpu_initialization=False, get_embedding_ranks=None,
                        get_position_embedding_ranks=None, parsed_args=None, store=None):
    """Parse and validate flags, set up the globals as upstream's `set_global_variables()` does (the
    number-of-microbatches calculator, `get_num_microbatches()`; the tokenizer, `get_tokenizer()`, padding
    `args.padded_vocab_size`; the timers, `get_timers()`; the --exit-signal-handler handler), join the process
    group launched by torchrun, build parallel groups, seed, and set up the rerun state machine of
    --rerun-mode (`get_rerun_state_machine()`).

    `args` replaces `sys.argv[1:]`. Upstream's keywords: `parsed_args` (a namespace already parsed, used instead
    of parsing), `skip_mpu_initialization` (set the arguments and globals only: no process group, no seeding),
    `get_embedding_ranks` / `get_position_embedding_ranks` (passed to `initialize_model_parallel`), `store` (the
    rendezvous store of a process group created here). `allow_no_cuda` is accepted and changes nothing: without a
    GPU the run uses gloo on the CPU. Calling it again replaces the globals of the previous call.

    Returns the validated arguments (also available from `megatron.training.global_vars.get_args()`).
    """
    del allow_no_cuda  # upstream asserts a GPU unless it is set; CPU runs are supported here either way
    parsed = parse_args(extra_args_provider, ignore_unknown_args, args) if parsed_args is None else parsed_args
    if dist.is_initialized():
        # As upstream: a process group the caller made (say with init_method="tcp://..." and no launcher
        # environment) is reused, and its rank and size are this run's.
        parsed.rank, parsed.world_size = dist.get_rank(), dist.get_world_size()
    validate_args(parsed, args_defaults)
    set_args(parsed)
    # As upstream, from start-up on: a signal during set-up is recorded, and acted on when the training loop starts.
    install_exit_signal_handler(parsed)
    try:
        setup_logging(parsed)
        destroy_num_microbatches_calculator()  # a previous call's
        set_up_microbatches(parsed)
        set_up_tokenizer(parsed)
        if not skip_mpu_initialization:
            set_cpu_threads()
            if getattr(parsed, "deterministic_mode", False):
                set_deterministic_mode()
            set_matmul_precision(parsed)
            initialize_distributed(parsed, get_embedding_ranks, get_position_embedding_ranks, store)
            set_random_seed(parsed.seed, parsed.data_parallel_random_init)
    except BaseException:
        uninstall_exit_signal_handler()
        destroy_num_microbatches_calculator()
        set_tokenizer(None)
        raise
    set_timers(Timers(parsed.timing_log_level, parsed.timing_log_option))  # get_timers(), as upstream
    setup_rerun_state_machine(parsed)  # --rerun-mode, as upstream's initialize_megatron() sets it
    return parsed


def set_up_tokenizer(args):
    """Build the tokenizer of --tokenizer-type, make it `get_tokenizer()`'s and pad its vocabulary into
    `args.padded_vocab_size` (with --use-checkpoint-args the checkpoint's rows, which validation put there),
    printing upstream's " > padded vocab ..." line on rank 0."""
    from megatron.training.tokenizer.tokenizer import padded_vocab_size
    from megatron.training.tokenizer import build_tokenizer_from_args, padded_vocab_message

    global _TOKENIZER_SET_UP
    tokenizer = build_tokenizer_from_args(args)
    set_tokenizer(tokenizer)
    args.padded_vocab_size = padded_vocab_size(args, tokenizer.vocab_size)
    _TOKENIZER_SET_UP = (args, tokenizer)
    if getattr(args, "rank", 0) == 0:
        print(padded_vocab_message(tokenizer.vocab_size, args.padded_vocab_size), flush=True)
    return tokenizer


_TOKENIZER_SET_UP = (None, None)  # (arguments, tokenizer) of the last set_up_tokenizer()


def tokenizer_set_up_for(args):
    """The global tokenizer when `set_up_tokenizer()` (`initialize_megatron()`) built it from `args` (and
    `args.padded_vocab_size` is padded from it), else None."""
    built_for, tokenizer = _TOKENIZER_SET_UP
    if built_for is not args:
        return None
    try:
        return tokenizer if get_tokenizer() is tokenizer else None
    except RuntimeError:  # unset since
        return None


def set_up_microbatches(args):
    """The number-of-microbatches calculator of --global-batch-size, --micro-batch-size, the data-parallel size
    and --rampup-batch-size (`get_num_microbatches()`, `get_current_global_batch_size()`)."""
    init_num_microbatches_calculator(
        args.rank, getattr(args, "rampup_batch_size", None), args.global_batch_size, args.micro_batch_size,
        args.data_parallel_size, decrease_batch_size_if_needed=getattr(args, "decrease_batch_size_if_needed", False),
    )


def set_cpu_threads():
    """Share the cores between the ranks of this node so they do not fight over them (CPU runs only)."""
    if accelerator.cuda_available():
        return
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))


def set_matmul_precision(args):
    """--disable-bf16-reduced-precision-matmul: bf16 cuBLAS GEMMs reduce in fp32 (only CUDA matmuls read it)."""
    if getattr(args, "disable_bf16_reduced_precision_matmul", False) and accelerator.cuda_available():
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


def set_deterministic_mode():
    """--deterministic-mode: ops without a deterministic kernel raise. cuBLAS needs a fixed workspace for that,
    set through the environment before CUDA starts."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def initialize_distributed(args, get_embedding_ranks=None, get_position_embedding_ranks=None, store=None):
    """Join (or reuse) the default process group, then build Megatron's model-parallel groups. `store`, when
    given, is where the ranks of a new process group meet."""
    from megatron.core import parallel_state

    backend = args.distributed_backend or accelerator.default_backend()
    args.distributed_backend = backend
    if args.local_rank is None:  # arguments validated elsewhere: --local-rank wins over LOCAL_RANK, as upstream
        args.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_rank = args.local_rank
    args.device = accelerator.device_for_backend(backend, local_rank)
    args.created_process_group = not dist.is_initialized()
    if args.created_process_group:
        timeout = timedelta(minutes=args.distributed_timeout_minutes)
        init_kwargs = _rendezvous(args.world_size, timeout) if store is None else {"store": store}
        if args.device.type == "cuda":
            init_kwargs["device_id"] = args.device
        dist.init_process_group(
            backend=backend,
            rank=args.rank,
            world_size=args.world_size,
            timeout=timeout,
            **init_kwargs,
        )
    if dist.get_world_size() != args.world_size:
        raise ValueError(
            f"the process group has {dist.get_world_size()} ranks but WORLD_SIZE says {args.world_size}"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=getattr(args, "virtual_pipeline_model_parallel_size", None),
        context_parallel_size=args.context_parallel_size,
        hierarchical_context_parallel_sizes=getattr(args, "hierarchical_context_parallel_sizes", None),
        expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1),
        expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None),
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        order=getattr(args, "rank_order", None) or DEFAULT_ORDER,  # --use-tp-pp-dp-mapping: tp-cp-ep-pp-dp
        get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
    )


def _rendezvous(world_size, timeout=timedelta(minutes=10)):
    """Where the ranks meet. torchrun sets MASTER_ADDR/MASTER_PORT for env://; a plain `python pretrain_gpt.py`
    (no launcher, WORLD_SIZE unset or 1) runs as one rank on an in-process store.

    After a restart (`torchrun --max-restarts`), the ranks meet on the agent's store, which still holds the keys the
    previous attempt's ranks wrote, their addresses among them: a rank that reads one connects to a process that is
    gone. Each restarted attempt therefore meets under a prefix of its own, as torchrun's attempt counter names it."""
    if "MASTER_ADDR" in os.environ:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
            return {}
        agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                    is_master=False, timeout=timeout)
        return {"store": dist.PrefixStore(f"/megatron/attempt_{attempt}", agent_store)}
    if world_size == 1:
        return {"store": dist.HashStore()}
    raise RuntimeError(
        f"WORLD_SIZE is {world_size} but MASTER_ADDR is not set: launch the ranks with torchrun "
        f"(torchrun --nproc-per-node {world_size} pretrain_gpt.py ...), which sets the rendezvous variables."
    )


def set_random_seed(seed, data_parallel_random_init=False):
    """Seed Python, numpy and torch like Megatron: offset per pipeline stage (and per DP rank if asked)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    if data_parallel_random_init:
        seed = seed + 10 * parallel_state.get_data_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)

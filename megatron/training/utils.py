"""Upstream Megatron-LM's `megatron.training.utils` names, and the adapters behind the package-level names of
`megatron.training` whose upstream signature or meaning differs from this repository's implementation.

A custom pretrain script written against upstream (`from megatron.training import get_args, pretrain, ...`,
`from megatron.training.utils import get_batch_on_this_tp_rank, ...`) runs here unchanged: each name does what
upstream's does, on this repository's data loaders, process groups and training loop. Names that cannot mean
anything here return what upstream returns when their feature is off (documented per name).
"""

import types

import torch
import torch.distributed as dist

from megatron.core.utils import get_batch_on_this_cp_rank, unwrap_model
from megatron.training.global_state import (
    get_adlr_autoresume,
    get_one_logger,
    get_signal_handler,
    get_tensorboard_writer,
    get_wandb_writer,
)

__all__ = [
    "append_to_progress_log",
    "average_losses_across_data_parallel_group",
    "calc_params_l2_norm",
    "get_adlr_autoresume",
    "get_batch_on_this_cp_rank",
    "get_batch_on_this_tp_rank",
    "get_blend_and_blend_per_split",
    "get_ltor_masks_and_position_ids",
    "get_model",
    "get_one_logger",
    "get_signal_handler",
    "get_tensorboard_writer",
    "get_wandb_writer",
    "inprocess_restart",
    "is_first_or_last_pipeline_stage",
    "is_last_rank",
    "logical_and_across_model_parallel_group",
    "pretrain",
    "print_params_min_max_norm",
    "print_rank_0",
    "print_rank_last",
    "report_memory",
    "set_startup_timestamps",
    "unwrap_model",
    "update_use_dist_ckpt",
]

# The keys of upstream's batch dict, in the order upstream's `get_batch` unpacks them with `batch.values()`.
BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


# ---------------------------------------------------------------------------------------------------------
# Printing on one rank
# ---------------------------------------------------------------------------------------------------------


def print_rank_0(message, rank=None):
    """Print `message` on global rank 0 only (on every process when torch.distributed is not initialised); with
    `rank` given, print when it is 0."""
    if rank is not None:
        should_print = rank == 0
    else:
        should_print = not dist.is_initialized() or dist.get_rank() == 0
    if should_print:
        print(message, flush=True)


def is_last_rank():
    """Whether this process is the last global rank (the one that prints the training log)."""
    return dist.get_rank() == dist.get_world_size() - 1


def print_rank_last(message):
    """Print `message` on the last global rank only (on every process when torch.distributed is not initialised)."""
    if not dist.is_initialized() or is_last_rank():
        print(message, flush=True)


# ---------------------------------------------------------------------------------------------------------
# Batches, blends, pipeline stages and losses
# ---------------------------------------------------------------------------------------------------------


def get_batch_on_this_tp_rank(data_iterator, mtp_on_this_rank=False):
    """The next micro-batch as upstream's dict (tokens, labels, loss_mask, attention_mask, position_ids) on this
    process's device; `attention_mask` is None when the dataset builds none (it does only for
    --reset-attention-mask: the causal mask is applied in the model).

    Upstream reads the batch on tensor-parallel rank 0 and broadcasts it over the tensor-parallel group. Here every
    rank has a data iterator of its own whose samples are those of its data-parallel rank, so the tensor-parallel
    ranks already read the same batch and nothing is broadcast; every rank draws from its iterator (also the
    middle pipeline stages, whose iterators then stay in step), and every key is filled on every stage.
    `mtp_on_this_rank` is accepted for upstream's signature: the batch holds everything multi-token prediction
    reads on every stage.
    """
    if data_iterator is None:
        raise ValueError("get_batch_on_this_tp_rank needs the data iterator pretrain() passes to forward_step; "
                         "got None")
    from megatron.training.global_state import get_args

    sample = next(data_iterator)
    missing = [key for key in BATCH_KEYS if key != "attention_mask" and key not in sample]
    if missing:
        raise KeyError(f"the data iterator's batch has no {missing} (keys: {sorted(sample)}): a GPT batch needs "
                       f"{list(BATCH_KEYS)}; build the datasets with megatron.core.datasets.gpt_dataset")
    device = get_args().device
    return {key: None if sample.get(key) is None else sample[key].to(device, non_blocking=True)
            for key in BATCH_KEYS}


def get_blend_and_blend_per_split(args):
    """(blend, blend_per_split) from the data flags, as upstream: `blend` = (prefixes, weights or None) from
    --data-path (or --data-args-path), `blend_per_split` = [train, valid, test] blends (each None where not given)
    from --train/valid/test-data-path (or --per-split-data-args-path); both None without data paths (mock data).

    Validation has already read the --data-args-path and --per-split-data-args-path files into the path flags.
    """
    from megatron.core.datasets.utils import blend_from_data_path
    from megatron.training.datasets.gpt_dataset_config import per_split_blends

    per_split = per_split_blends(args)
    if per_split is not None:
        return None, list(per_split)
    if args.data_path:
        return blend_from_data_path(args.data_path), None
    return None, None


def is_first_or_last_pipeline_stage(vp_stage=None):
    """Whether this rank runs the first or the last pipeline stage; with `vp_stage`, whether that model chunk
    (virtual stage) of an interleaved pipeline is the first or last stage of the model."""
    from megatron.core import parallel_state

    ignore_virtual = vp_stage is None
    return (parallel_state.is_pipeline_first_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
            or parallel_state.is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage))


def average_losses_across_data_parallel_group(losses):
    """The given scalar losses (detached, one 1-D tensor) averaged over the data-parallel group, for reporting."""
    from megatron.core import parallel_state

    averaged = torch.cat([loss.clone().detach().view(1) for loss in losses])
    group = parallel_state.get_data_parallel_group()
    dist.all_reduce(averaged, group=group)
    return averaged / dist.get_world_size(group=group)


# ---------------------------------------------------------------------------------------------------------
# Package-level names of `megatron.training` with upstream's signature
# ---------------------------------------------------------------------------------------------------------

_PRETRAIN_ARGUMENTS_NOT_HERE = {
    "get_embedding_ranks": "the embedding group is always the first and last pipeline stage (upstream's default)",
    "get_position_embedding_ranks": "the position-embedding group is always the first pipeline stage (upstream's "
                                    "default)",
    "store": "in-process restart is not available (inprocess_restart.maybe_wrap_for_inprocess_restart returns "
             "store=None)",
    "inprocess_call_wrapper": "in-process restart is not available",
}


def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
             process_non_loss_data_func=None, extra_args_provider=None, args_defaults={}, get_embedding_ranks=None,
             get_position_embedding_ranks=None, non_loss_data_func=None, store=None, inprocess_call_wrapper=None,
             *, argv=None):
    """Upstream's `pretrain()` signature over `megatron.training.training.pretrain`.

    The arguments upstream adds for features this repository does not have must stay None (a value raises,
    naming it); `argv` (keyword only) replaces `sys.argv[1:]`, as in `megatron.training.training.pretrain`.
    """
    given = {"get_embedding_ranks": get_embedding_ranks, "get_position_embedding_ranks": get_position_embedding_ranks,
             "store": store, "inprocess_call_wrapper": inprocess_call_wrapper}
    for name, value in given.items():
        if value is not None:
            raise ValueError(f"pretrain({name}=...) is not supported: {_PRETRAIN_ARGUMENTS_NOT_HERE[name]}; "
                             f"leave {name} None")
    from megatron.training.training import pretrain as run_pretrain

    return run_pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                        process_non_loss_data_func=process_non_loss_data_func,
                        extra_args_provider=extra_args_provider, args_defaults=args_defaults,
                        non_loss_data_func=non_loss_data_func, argv=argv)


def get_model(model_provider_func, model_type=None, wrap_with_ddp=True):
    """Upstream's `get_model(model_provider_func, model_type, wrap_with_ddp)`: the list of this rank's model
    chunks, built from the parsed arguments (`initialize_megatron()` first). `model_type` must be
    `ModelType.encoder_or_decoder` (or None)."""
    from megatron.training.global_state import get_args
    from megatron.training.model_setup import get_model as build_model
    from megatron.training.training import resolve_model_type

    if model_type is not None:
        resolve_model_type(model_type)
    return build_model(model_provider_func, get_args(), wrap_with_ddp=wrap_with_ddp)


def set_startup_timestamps(program_start=None, main_entry=None):
    """Accepted for upstream's scripts, which pass the process's start times for upstream's start-up timing log.
    That log does not exist here (`pretrain()` times its own set-up phases), so the times are not used."""


def _maybe_wrap_for_inprocess_restart(pretrain_func):
    """(pretrain_func, None), as upstream without --inprocess-restart (in-process restart does not exist here)."""
    return pretrain_func, None


# Upstream's module `megatron.training.inprocess_restart`, as scripts use it:
# `pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)`.
inprocess_restart = types.SimpleNamespace(maybe_wrap_for_inprocess_restart=_maybe_wrap_for_inprocess_restart)


# ---------------------------------------------------------------------------------------------------------
# Masks, norms, memory and progress lines
# ---------------------------------------------------------------------------------------------------------


def get_ltor_masks_and_position_ids(data, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """(attention_mask, loss_mask, position_ids) of a left-to-right model for the token ids `data` [b, s], as
    upstream: `attention_mask` [1 (b with reset_attention_mask), 1, s, s] bool, True where masked out (the causal
    mask; with `reset_attention_mask` no token sees past an `eod_token` before it); `loss_mask` [b, s] float, 0 on
    `eod_token`s with `eod_mask_loss`; `position_ids` [b, s], restarting at 0 after each `eod_token` with
    `reset_position_ids`. The GPT datasets build the same from --reset-position-ids, --reset-attention-mask and
    --eod-mask-loss for every sample they return."""
    batch_size, seq_length = data.shape
    is_eod = data == eod_token
    loss_mask = torch.ones(data.shape, dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    positions = torch.arange(seq_length, dtype=torch.long, device=data.device)
    # The first position of each token's document: one past the last eod before it (0 in the first document).
    after_eod = torch.zeros(data.shape, dtype=torch.long, device=data.device)
    after_eod[:, 1:] = torch.where(is_eod[:, :-1], positions[1:], 0)
    document_start = torch.cummax(after_eod, dim=1).values
    position_ids = positions - document_start if reset_position_ids else positions.unsqueeze(0).expand_as(data)
    causal = torch.tril(torch.ones(seq_length, seq_length, dtype=torch.bool, device=data.device))
    if reset_attention_mask:  # a query sees the keys of its own document only
        allowed = causal & (positions.view(1, 1, seq_length) >= document_start.unsqueeze(2))
    else:
        allowed = causal.unsqueeze(0)
    return ~allowed.unsqueeze(1), loss_mask, position_ids


def calc_params_l2_norm(model, force_create_fp32_copy=False):
    """The L2 norm of all the model's parameters, each element counted once over the tensor-, pipeline-, expert-
    and data-parallel ranks (tensor-parallel duplicates and the last stage's copy of a shared embedding left out,
    sharded parameters summed over their shards), in fp32, as the log's `params norm` (--log-params-norm).
    `model` is a module or the list of this rank's model chunks. Collective over the world. Parameters are always
    converted to fp32 for the sum, so `force_create_fp32_copy` changes nothing."""
    import math

    from megatron.core.expert_parameters import (
        expert_grad_stats_groups,
        model_has_expert_parameters,
        split_expert_parameters,
    )
    from megatron.core.optimizer.clip_grads import default_grad_stats_groups, global_norms_fp32, tensors_counted_once

    chunks = model if isinstance(model, (list, tuple)) else [model]
    dense, expert = split_expert_parameters([param for chunk in chunks for param in chunk.parameters()])
    parts = [(tensors_counted_once(dense, _detached), default_grad_stats_groups())]
    if model_has_expert_parameters(chunks):
        parts.append((tensors_counted_once(expert, _detached), expert_grad_stats_groups()))
    return math.sqrt(sum(norm ** 2 for norm in global_norms_fp32(parts, 2.0, _collective_device())))


def _detached(param):
    return param.detach()


def _collective_device():
    from megatron.core.device_utils import get_device_for_group

    return get_device_for_group() if dist.is_initialized() else torch.device("cpu")


def logical_and_across_model_parallel_group(input):
    """Whether `input` is True on every rank of this rank's model-parallel group (tensor x pipeline)."""
    from megatron.core import parallel_state

    value = torch.tensor([1 if input is True else 0], dtype=torch.int, device=_collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=parallel_state.get_model_parallel_group())
    return value.item() == 1


def print_params_min_max_norm(optimizer, iteration):
    """Print, on every rank, one line per parameter the optimizer steps (in its param groups' order): iteration,
    rank, 1-based index, whether it is tensor-parallel, then its min, max and L2 norm. A sharded parameter
    (distributed optimizer, FSDP) shows this rank's shard; an empty shard shows nan."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    lines = ["iteration, rank, index, tensor-model-parallel, min, max, norm"]
    params = [param for group in optimizer.param_groups for param in group["params"]]
    for index, param in enumerate(params, start=1):
        values = (param.to_local() if hasattr(param, "to_local") else param).detach().float()
        if values.numel() == 0:
            low = high = norm = float("nan")
        else:
            low, high, norm = values.min().item(), values.max().item(), torch.linalg.norm(values).item()
        tensor_parallel = int(getattr(param, "tensor_model_parallel", False))
        lines.append(f"{iteration:7d}, {rank:4d}, {index:4d}, {tensor_parallel:2d}, {low:.6E}, {high:.6E}, {norm:.6E}")
    print("\n".join(lines), flush=True)


def report_memory(name):
    """Print this rank's memory in MB, on data-parallel rank 0, as upstream: "[Rank r] <name> memory (MB) |
    allocated: ... | max allocated: ... | reserved: ... | max reserved: ..." on a GPU; on CPU, where there is no
    caching allocator, "| resident: ... | max resident: ..." (the process's resident set size)."""
    from megatron.core import parallel_state
    from megatron.core.device_utils import get_current_device
    from megatron.training.accelerator import memory_counters_bytes

    counters = memory_counters_bytes(get_current_device())
    line = f"{name} memory (MB)" + "".join(f" | {key}: {value / 2 ** 20}" for key, value in counters.items())
    data_parallel_rank = (parallel_state.get_data_parallel_rank() if parallel_state.model_parallel_is_initialized()
                          else 0)
    if data_parallel_rank == 0:
        print(f"[Rank {dist.get_rank() if dist.is_initialized() else 0}] {line}", flush=True)


def append_to_progress_log(string, barrier=True):
    """Append "<time>\tJob ID: <SLURM_JOB_ID>\t# GPUs: <world size>\t<string>" to <--save>/progress.txt on rank 0,
    as upstream (nothing without --save); with `barrier`, after a barrier of all ranks. --log-progress writes its
    own lines to the same file."""
    import datetime
    import os

    from megatron.training.global_state import get_args
    from megatron.training.progress_log import TIME_FORMAT, progress_log_path

    args = get_args()
    if args.save is None:
        return
    if barrier and dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        stamp = datetime.datetime.now().strftime(TIME_FORMAT)
        os.makedirs(args.save, exist_ok=True)
        with open(progress_log_path(args), "a") as stream:
            stream.write(f"{stamp}\tJob ID: {os.environ.get('SLURM_JOB_ID', '')}\t# GPUs: {args.world_size}\t"
                         f"{string}\n")


def update_use_dist_ckpt(args):
    """`args.use_dist_ckpt`, as upstream: True for every --ckpt-format but `torch`."""
    args.use_dist_ckpt = args.ckpt_format != "torch"

"""Upstream Megatron-LM's `megatron.training.utils` names, and the adapters behind the package-level names of
`megatron.training` whose upstream signature or meaning differs from this repository's implementation.

A custom pretrain script written against upstream (`from megatron.training import get_args, pretrain, ...`,
`from megatron.training.utils import get_batch_on_this_tp_rank, ...`) runs here unchanged: each name does what
upstream's does, on this repository's data loaders, process groups and training loop. Names that cannot mean
anything here either return what upstream returns when their feature is off (documented per name) or are absent,
and importing them raises an ImportError that says what to use instead.
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
    "average_losses_across_data_parallel_group",
    "get_adlr_autoresume",
    "get_batch_on_this_cp_rank",
    "get_batch_on_this_tp_rank",
    "get_blend_and_blend_per_split",
    "get_model",
    "get_one_logger",
    "get_signal_handler",
    "get_tensorboard_writer",
    "get_wandb_writer",
    "inprocess_restart",
    "is_first_or_last_pipeline_stage",
    "is_last_rank",
    "pretrain",
    "print_rank_0",
    "print_rank_last",
    "set_startup_timestamps",
    "unwrap_model",
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
# Upstream names with no meaning here
# ---------------------------------------------------------------------------------------------------------

UNAVAILABLE = {
    "get_ltor_masks_and_position_ids": (
        "the GPT datasets build each sample's loss_mask, position_ids and (with --reset-attention-mask) "
        "attention_mask from --eod-mask-loss, --reset-position-ids and --reset-attention-mask; read them from the "
        "batch (get_batch_on_this_tp_rank(data_iterator))"
    ),
    "calc_params_l2_norm": (
        "the training loop logs the parameter norm itself with --log-params-norm"
    ),
}


def __getattr__(name):
    if name in UNAVAILABLE:
        # An ImportError (not AttributeError), so that `from megatron.training.utils import name` shows this text.
        raise ImportError(f"megatron.training.utils.{name} is not available here: {UNAVAILABLE[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

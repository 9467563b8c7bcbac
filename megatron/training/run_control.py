"""Run control flags of the training loop: the wall-clock limit (--exit-duration-in-mins), releasing the
allocator's unused memory (--empty-unused-memory-level), the root logging level (--logging-level), the
check that data-parallel replicas hold the same weights (--check-weight-hash-across-dp-replicas-interval), the
device synchronisation every --train-sync-interval iterations and the steps dropped by --iterations-to-skip
(`skip_training_step`).

Every decision that makes a rank stop or fail is agreed on by all ranks with one collective, so no rank waits
in a collective the others have left.
"""

import hashlib
import logging
import os
import time

import torch
import torch.distributed as dist

from megatron.training.accelerator import synchronize as synchronize_device

LOGGING_LEVEL_ENV = "MEGATRON_LOGGING_LEVEL"

logger = logging.getLogger(__name__)


def setup_logging(args):
    """Set the root logger's level: --logging-level wins over the environment's MEGATRON_LOGGING_LEVEL; with
    neither the level is left alone. Returns the level set, or None."""
    level = None
    from_env = os.environ.get(LOGGING_LEVEL_ENV)
    if from_env is not None:
        try:
            level = int(from_env)
        except ValueError:
            raise ValueError(f"{LOGGING_LEVEL_ENV}={from_env!r} must be an integer logging level (e.g. 20 for "
                             "INFO); fix or unset it, or pass --logging-level") from None
    if args.logging_level is not None:
        level = args.logging_level
    if level is not None:
        logging.getLogger().setLevel(level)
    return level


class ExitDuration:
    """--exit-duration-in-mins: the minutes since `start_time` (the earliest start over all ranks), compared with
    the limit on every rank and agreed on with a MAX all-reduce, so all ranks stop at the same step."""

    clock = staticmethod(time.time)

    def __init__(self, minutes, start_time, device):
        self.minutes = minutes
        self.device = device
        start = torch.tensor([start_time], dtype=torch.float64, device=device)
        if minutes is not None and dist.is_initialized():
            dist.all_reduce(start, op=dist.ReduceOp.MIN)
        self.start_time = float(start.item())

    def elapsed_minutes(self):
        return (self.clock() - self.start_time) / 60.0

    def reached(self):
        """Whether any rank is past the limit (collective when a limit is set; False without one)."""
        if self.minutes is None:
            return False
        flag = torch.tensor([1 if self.elapsed_minutes() > self.minutes else 0], dtype=torch.int32,
                            device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def empty_unused_memory(args, level):
    """Return the allocator's cached, unused blocks to the device when --empty-unused-memory-level >= `level`
    (1: after forward-backward and each evaluation step; 2: also after the optimizer step). The CPU allocator
    keeps no cache, so there this releases nothing."""
    if args.empty_unused_memory_level >= level:
        from megatron.training.accelerator import empty_cache

        empty_cache(args.device)
        return True
    return False


def synchronize_at_interval(args, completed):
    """--train-sync-interval N: after every N-th completed iteration, wait for the device's queued work, as
    upstream, so the host cannot run more than N iterations ahead of the GPU (a no-op on CPU). Returns whether it
    synchronised."""
    interval = getattr(args, "train_sync_interval", None)
    if interval and completed % interval == 0:
        synchronize_device(args.device)
        return True
    return False


def parameter_digest(param):
    """SHA-1 of the whole parameter's bytes (a sharded DTensor is gathered first), as 20 uint8 values."""
    from torch.distributed.tensor import DTensor

    value = param.detach()
    if isinstance(value, DTensor):
        value = value.full_tensor()
    data = value.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return torch.tensor(list(hashlib.sha1(data.tobytes()).digest()), dtype=torch.uint8)


def mismatched_parameters(model_chunks, group, device, include=None):
    """Names of the parameters (those `include(param)` accepts, default all) whose digest differs between the
    ranks of `group` (the data-parallel replicas: the same model-parallel part of the model), identical on every
    rank of the group (collective)."""
    names, digests = [], []
    for index, chunk in enumerate(model_chunks):
        for name, param in chunk.named_parameters():
            if include is not None and not include(param):
                continue
            names.append(f"chunk {index}: {name}" if len(model_chunks) > 1 else name)
            digests.append(parameter_digest(param))
    if not digests:
        return []
    local = torch.stack(digests).to(device=device, dtype=torch.int32)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    differs = torch.zeros(len(names), dtype=torch.bool, device=device)
    for other in gathered[1:]:
        differs |= (other != gathered[0]).any(dim=1)
    return [name for name, bad in zip(names, differs.tolist()) if bad]


def check_weight_hashes(model_chunks, iteration, args):
    """--check-weight-hash-across-dp-replicas-interval: raise on every rank when the data-parallel replicas of
    a parameter differ (SHA-1 of each whole parameter, gathered over the data-parallel x context-parallel
    group; for expert parameters over the expert data-parallel group), naming the parameters; returns True when
    they all match."""
    from megatron.core import parallel_state

    from megatron.training.param_sync import finish_param_syncs

    finish_param_syncs(model_chunks)  # post-step gathers still in flight (overlapped param gather) land first
    from megatron.core.expert_parameters import is_expert_parameter

    # Mixture-of-Experts experts are replicated over the expert data-parallel group only (the ranks holding them).
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    bad = mismatched_parameters(model_chunks, group, args.device, include=lambda p: not is_expert_parameter(p))
    bad += mismatched_parameters(model_chunks, parallel_state.get_expert_data_parallel_group(), args.device,
                                 include=is_expert_parameter)
    if bad:
        raise RuntimeError(f"--check-weight-hash-across-dp-replicas-interval: at iteration {iteration} the "
                           f"data-parallel replicas hold different weights for {len(bad)} parameter(s): "
                           f"{', '.join(bad[:8])}")
    if dist.get_rank() == 0:
        print(f"weight hashes match across data-parallel replicas at iteration {iteration}", flush=True)
    return True


def weight_hash_due(args, iteration):
    interval = args.check_weight_hash_across_dp_replicas_interval
    return interval is not None and iteration % interval == 0


def should_skip_step(args, completed):
    """--iterations-to-skip: whether the step after `completed` iterations only drops its global batch."""
    return completed in args.iterations_to_skip


def skip_training_step(data_iterator, num_microbatches):
    """Draw and drop the microbatches one step would use, so that later steps see the data they would have seen.

    Every pipeline stage draws every microbatch (pretrain_gpt's get_batch), so each rank draws `num_microbatches`
    from its iterator (from each, when it holds one per model chunk). The rerun state machine counts the step too,
    keeping its iteration numbers equal to the loop's. Returns the number of batches drawn on this rank."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    get_rerun_state_machine().current_iteration += 1
    iterators = data_iterator if isinstance(data_iterator, (list, tuple)) else [data_iterator]
    drawn = 0
    for iterator in iterators:
        if iterator is None:
            continue
        for _ in range(num_microbatches):
            next(iterator)
            drawn += 1
    return drawn

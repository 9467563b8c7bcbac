"""`--ckpt-format torch_dist` (also `torch_dcp`, `fsdp_dtensor`): the logical checkpoint of a training run.

Layout under the checkpoint root:

    latest_checkpointed_iteration.txt     the last published checkpoint's iteration, written last
    iter_0000010/                         one published checkpoint
        .metadata  __<rank>_0.distcp      torch.distributed.checkpoint index and per-rank data files
        metadata.json                     format, iteration and the layout that wrote it (for tools)
    iter_0000020.tmp/                     a save in progress (or one that was interrupted): never loaded
    iter_0000010.replaced/                the previous copy while iteration 10 is saved again (see publish)

Keys (see megatron.core.dist_checkpointing): `model.<logical name>`, `optimizer.*`, `scheduler`,
`rng_state.<global rank>`, `common` (iteration, consumed samples, args, layout). All ranks write into the
temporary directory; when every rank has succeeded, global rank 0 renames it into place and then points the
tracker at it, so an interrupted or failed save leaves the previous checkpoint the latest, and readable.
"""

import copy
import os
import shutil
import time

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import rng_mapping, serialization, wrappers
from megatron.core.dist_checkpointing.checkpoint_directory import (  # noqa: F401  (part of this module's API)
    METADATA_JSON,
    REPLACED_SUFFIX,
    TEMPORARY_SUFFIX,
    TRACKER_FILENAME,
    CheckpointSaveError,
    iteration_dir_name,
    publish,
    published_directory,
    published_iterations,
    unwritten_save_advice,
)
from megatron.core.dist_checkpointing.param_groups import GROUPING_FLAGS
from megatron.core.dist_checkpointing.strictness import apply_strictness
from megatron.core.fp8.checkpoint import (fp8_histories_report, split_missing_fp8_histories,
                                         unused_fp8_histories_report)
from megatron.training import checkpoint_state, modelopt_checkpoint
from megatron.training.checkpoint_args import (
    check_resumed_optimizer,
    check_same_architecture,
    layer_count_hint,
    saved_true_vocab_size,
    true_vocab_size,
)
from megatron.training.checkpoint_retention import prune_to_retain_interval, remove_superseded_leftovers
from megatron.training.random_state import rng_state, set_rng_state

_async_queue = None
_failed_background_save = None  # why the background save just finalised was not published (None: it was)


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _print0(message):
    if _rank() == 0:
        print(message, flush=True)


def async_queue(args):
    global _async_queue
    if _async_queue is None:
        from megatron.training.async_checkpoint import AsyncCheckpointQueue

        _async_queue = AsyncCheckpointQueue(args.device, getattr(args, "use_persistent_ckpt_worker", False))
    return _async_queue


def finalize_async_save(args, blocking, raise_if_failed=False):
    """Publish a finished background save (all ranks call this at the same points); True if one was.
    A save that failed is reported and training goes on; with `raise_if_failed` (the end of a run, where no
    later save makes up for it) it raises CheckpointSaveError on every rank."""
    global _failed_background_save
    if _async_queue is None or not _async_queue.pending:
        return False
    _failed_background_save = None
    finalized = _async_queue.finalize(blocking=blocking)
    failure, _failed_background_save = _failed_background_save, None
    if failure is not None and raise_if_failed:
        raise CheckpointSaveError(failure)
    return finalized


def close_async_queue():
    global _async_queue
    if _async_queue is not None:
        _async_queue.close()
        _async_queue = None


def forget_async_queue():
    """At the end of pretrain(): the queue's process group belongs to this run (a later run in the same process
    makes its own); no collective, so a failed run does not wait here."""
    global _async_queue
    if _async_queue is not None:
        _async_queue.abandon()
        _async_queue = None


# ---------------------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------------------


def stage(state):
    """A CPU snapshot of `state` that training may not change under a background write."""
    from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor

    staged = {}
    for key, value in state.items():
        if isinstance(value, ShardedLogicalTensor):
            staged[key] = value.staged()
        elif torch.is_tensor(value):
            staged[key] = value.detach().to("cpu", copy=True)
        else:
            staged[key] = copy.deepcopy(value)  # e.g. the args, which training keeps updating
    return staged


def save_dist_checkpoint(iteration, model_chunks, optimizer, scheduler, args):
    """Save `iteration` under `args.save` (collective). Returns the seconds the training thread spent."""
    start = time.perf_counter()
    finalize_async_save(args, blocking=True)  # one save in flight at a time
    state, layout = checkpoint_state.state_to_save(iteration, model_chunks, optimizer, scheduler, args)
    root = args.save
    temporary = os.path.join(root, iteration_dir_name(iteration) + TEMPORARY_SUFFIX)
    failure = None
    if _rank() == 0:
        try:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(temporary, ignore_errors=True)  # left by an interrupted save of this iteration
        except OSError as error:  # e.g. --save under a read-only directory, or naming a file
            failure = f"{type(error).__name__}: {error}"
    raise_if_any_rank_failed(failure, root, iteration, temporary)
    keep_last_n = getattr(args, "keep_last_n", None)

    def finish(succeeded):
        global _failed_background_save
        _barrier()
        if not succeeded:
            if _rank() == 0:
                shutil.rmtree(temporary, ignore_errors=True)
            _failed_background_save = (f"checkpoint of iteration {iteration} was NOT saved: a background write "
                                       f"failed (see above); {unwritten_save_advice(root)}")
            _print0(_failed_background_save)
            _barrier()
            return
        failure = None
        if _rank() == 0:
            try:
                publish(root, iteration, temporary, layout, keep_last_n)
                prune_to_retain_interval(root, iteration, getattr(args, "save_retain_interval", None))
                remove_superseded_leftovers(root, iteration)
            except OSError as error:  # e.g. the disk filled up before the tracker could be written
                failure = f"{type(error).__name__}: {error}"
        try:
            raise_if_any_rank_failed(failure, root, iteration, temporary, publishing=True)
        except CheckpointSaveError as error:
            if not getattr(args, "async_save", False):
                raise
            _failed_background_save = f"checkpoint of iteration {iteration} was NOT saved: {error}"
            _print0(_failed_background_save)  # training goes on
            return
        if getattr(args, "async_save", False):  # a synchronous save's line comes from the training loop
            _print0(f"saved checkpoint of iteration {iteration} to {root} (--ckpt-format {args.ckpt_format})")
        _barrier()

    if getattr(args, "async_save", False):
        queue = async_queue(args)
        staged = stage(state)
        queue.schedule(lambda: serialization.save(staged, temporary, process_group=queue.process_group),
                       finish, f"checkpoint iteration {iteration}")
    else:
        try:
            serialization.save(state, temporary)
        except serialization.CheckpointError as error:  # raised on every rank: DCP gathers the ranks' failures
            _barrier()
            if _rank() == 0:
                shutil.rmtree(temporary, ignore_errors=True)
            _barrier()
            raise CheckpointSaveError(f"{error}; {unwritten_save_advice(root)}") from error
        finish(True)
    return time.perf_counter() - start


def raise_if_any_rank_failed(failure, root, iteration, temporary, publishing=False):
    """Collective: when any rank could not write its part (`failure`: what went wrong, else None), remove the
    unfinished `temporary` directory and raise on every rank, naming it and what to do; no rank is left waiting.
    `publishing`: the failure is rank 0's, renaming the written directory into place or updating the tracker."""
    failures = checkpoint_state.all_gather_objects(failure)
    if all(each is None for each in failures):
        return
    if _rank() == 0:
        shutil.rmtree(temporary, ignore_errors=True)
    _barrier()
    causes = {}  # cause -> ranks, in rank order
    for rank, each in enumerate(failures):
        if each is not None:
            causes.setdefault(each, []).append(rank)
    detail = "; ".join(f"rank {', '.join(map(str, ranks))}: {cause}" for cause, ranks in causes.items())
    action = (f"publish the checkpoint of iteration {iteration} (rename {temporary} into place, then point "
              f"{os.path.join(root, TRACKER_FILENAME)} at it)" if publishing else
              f"write the checkpoint of iteration {iteration} to {temporary}")
    raise CheckpointSaveError(f"could not {action} ({detail}); {unwritten_save_advice(root)}")


# ---------------------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------------------


def _check_not_legacy(directory):
    if os.path.isdir(directory) and any(name.startswith("mp_rank_") for name in os.listdir(directory)):
        raise serialization.CheckpointError(
            f"{directory} is a --ckpt-format torch checkpoint; load it with --ckpt-format torch, or pass "
            "--auto-detect-ckpt-format (which loads either format and saves in --ckpt-format), or convert it with "
            "tools/checkpoint/convert_legacy.py")


def load_dist_checkpoint(model_chunks, optimizer, scheduler, args, iteration, root=None):
    """Load checkpoint `iteration` under `root` (default `args.load`) into the model (and optimizer, scheduler,
    RNG as the flags allow); returns (iteration to resume from, report lines)."""
    directory, recovered = published_directory(root or args.load, iteration)
    _check_not_legacy(directory)
    metadata = serialization.read_metadata(directory)
    common = serialization.read_objects(directory, ["common"], metadata=metadata)["common"]
    strictness = getattr(args, "dist_ckpt_strictness", "assume_ok_unexpected")
    report = checkpoint_state.LoadReport(directory, common)
    if recovered:
        report.notes.append(f"{recovered} was missing (a save of the same iteration was interrupted while replacing "
                            f"it); loaded the previous copy {directory}, which the next save of this iteration "
                            "replaces")

    # A modelopt-converted model is converted again first: its quantizers' amaxes are among its tensors.
    modelopt_note = modelopt_checkpoint.restore_modelopt_state(model_chunks, directory,
                                                                serialization.object_keys(metadata))
    if modelopt_note is not None:
        report.loaded.append(modelopt_note)
    fp32_weights = _fp32_weight_names(metadata)
    model_targets, finish_model_load = checkpoint_state.model_targets(model_chunks, fp32_weights)
    # Same model? Checked before the shapes, whose error would name a tensor rather than the flag that differs
    # (--num-experts, --hidden-size, ...), and before anything is read (also under --finetune).
    saved_args = common.get("args")
    saved_vocab_size = saved_true_vocab_size(common.get(checkpoint_state.VOCAB_SIZE_KEY), saved_args)
    check_same_architecture(directory, saved_args, args, saved_vocab_size, true_vocab_size(args))
    checkpoint_state.adapt_vocab_padding(model_targets, metadata, args, report)
    serialization.check_shapes(model_targets, metadata, directory)
    mismatch = serialization.key_mismatch(model_targets, metadata, ["model."])
    # FP8 amax histories a checkpoint lacks (a run without delayed FP8 scaling) are no error: they start empty.
    other_missing, fresh_fp8_histories = split_missing_fp8_histories(mismatch.missing)
    # ... and those of a delayed-scaling run that this run (no FP8, or tensorwise) has no buffers for are unused.
    other_unexpected, unused_fp8_histories = split_missing_fp8_histories(mismatch.unexpected)
    mismatch = apply_strictness(strictness, mismatch._replace(missing=other_missing, unexpected=other_unexpected),
                                directory, _print0, hint=layer_count_hint(saved_args, args))
    for key in mismatch.missing + fresh_fp8_histories:
        model_targets.pop(key, None)
    serialization.load(model_targets, directory, metadata=metadata)
    finish_model_load(set(model_targets))
    report.loaded.append(f"model ({len(model_targets)} tensors)")
    report.add_mismatch("model", mismatch)
    if fresh_fp8_histories:
        report.not_loaded.append(fp8_histories_report(fresh_fp8_histories))
    if unused_fp8_histories:
        report.not_loaded.append(unused_fp8_histories_report(unused_fp8_histories))

    if optimizer is not None:
        # Main weights follow the model weights just loaded, unrounded where the checkpoint holds them in fp32;
        # the optimizer state's `fp32_param`, where it is loaded, replaces them.
        checkpoint_state.refresh_main_params(optimizer)
        _load_fp32_weights_into_main_weights(optimizer, model_chunks, fp32_weights, metadata, directory, args,
                                             report)

    skip_optimizer = None  # why the optimizer state is not loaded
    if args.finetune:
        skip_optimizer = "--finetune"
    elif args.no_load_optim:
        skip_optimizer = "--no-load-optim"
    elif not any(key.startswith("optimizer.") for key in metadata.state_dict_metadata):
        skip_optimizer = "the checkpoint has none: saved with --no-save-optim or converted from weights"
    if optimizer is not None and skip_optimizer is None:
        check_resumed_optimizer(saved_args, args, directory)
        _load_optimizer(optimizer, model_chunks, metadata, directory, strictness, report, _print0, args)
        if scheduler is not None and "scheduler" in metadata.state_dict_metadata:
            saved = serialization.read_objects(directory, ["scheduler"], metadata=metadata)["scheduler"]
            scheduler.load_state_dict(saved)
            report.loaded.append("scheduler")
    elif optimizer is not None:
        report.not_loaded.append(f"optimizer and scheduler ({skip_optimizer})")

    _load_rng(args, directory, metadata, common, report)
    if args.finetune:
        args.consumed_train_samples, args.skipped_train_samples = 0, 0
        report.not_loaded.append("iteration and consumed samples (--finetune starts at 0)")
        iteration = 0
    else:
        args.consumed_train_samples = common.get("consumed_train_samples", 0)
        args.skipped_train_samples = common.get("skipped_train_samples", 0)
        report.loaded.append(f"iteration {iteration}, consumed samples {args.consumed_train_samples}")
    _barrier()
    return iteration, report


def _fp32_weight_names(metadata):
    """The logical names of the model weights the checkpoint holds in fp32: an fp32 run's, or FSDP2's (which keeps
    fp32 weights and computes in bf16), where a bf16 run of another wrapper saves bf16 ones and the fp32 main
    weights as `optimizer.state.<name>.fp32_param`."""
    return {key[len("model."):] for key, dtype in serialization.tensor_dtypes(metadata).items()
            if key.startswith("model.") and dtype == torch.float32}


def _load_fp32_weights_into_main_weights(optimizer, model_chunks, fp32_weights, metadata, directory, args, report):
    """Read the checkpoint's fp32 model weights into the fp32 main weights that a bf16 / fp16 model keeps beside
    its own copy (into which the model load rounded them). Collective."""
    if not fp32_weights or not (getattr(args, "bf16", False) or getattr(args, "fp16", False)):
        return
    targets = {f"model.{name}": pieces
               for name, pieces in wrappers.main_weight_targets(optimizer, model_chunks, fp32_weights).items()}
    checkpoint_state.adapt_vocab_padding(targets, metadata, args, report)
    serialization.check_shapes(targets, metadata, directory)
    serialization.load(targets, directory, metadata=metadata)


def _load_optimizer(optimizer, model_chunks, metadata, directory, strictness, report, log, args):
    saved_keys = list(metadata.state_dict_metadata)
    targets, install = wrappers.optimizer_load_targets(optimizer, model_chunks, saved_keys)
    checkpoint_state.adapt_vocab_padding(targets, metadata, args, report)
    serialization.check_shapes(targets, metadata, directory)
    mismatch = apply_strictness(strictness, serialization.key_mismatch(targets, metadata, ["optimizer.state."]),
                                directory, log)
    for key in mismatch.missing:
        targets.pop(key, None)
    for key in ("optimizer.step", "optimizer.param_groups", "optimizer.grad_scaler"):
        if key in metadata.state_dict_metadata:
            targets[key] = None
    serialization.load(targets, directory, metadata=metadata)
    unmatched = install(targets) or []
    report.loaded.append(f"optimizer ({sum(1 for k in targets if k.startswith('optimizer.state.'))} tensors)")
    if unmatched:
        report.notes.append(
            f"the checkpoint holds no optimizer param group grouped as this run's group(s) "
            f"{', '.join(map(str, unmatched))} ({GROUPING_FLAGS} changed the grouping): their parameters' state "
            "was loaded by name, their learning-rate and weight-decay settings come from this run's flags")
    report.add_mismatch("optimizer", mismatch)


def _load_rng(args, directory, metadata, common, report):
    """Restore each rank's random-number streams from the saved rank with the same coordinates (see
    megatron.core.dist_checkpointing.rng_mapping); the report lists what was not restored, on which ranks, and why.
    Collective."""
    if args.finetune or args.no_load_rng:
        report.not_loaded.append("RNG state (" + ("--finetune" if args.finetune else "--no-load-rng") + ")")
        return
    saved_ranks = sorted(int(key[len(checkpoint_state.RNG_PREFIX):]) for key in metadata.state_dict_metadata
                         if key.startswith(checkpoint_state.RNG_PREFIX))
    if not saved_ranks:
        report.not_loaded.append("RNG state (the checkpoint has none: saved with --no-save-rng)")
        return
    table = common.get(checkpoint_state.RNG_COORDINATES_KEY)
    if table is None:  # written before coordinates were recorded: restore only at the very same layout
        saved_layout = dict(common.get("layout", {}))
        current = checkpoint_state.layout_of(args, [])
        if any(saved_layout.get(name) != current[name] for name in
               ("tensor_model_parallel_size", "pipeline_model_parallel_size", "world_size")) or \
                checkpoint_state.data_times_context_parallel(saved_layout) != \
                checkpoint_state.data_times_context_parallel(current):
            report.not_loaded.append("RNG state (saved at another parallel layout by a checkpoint that does not "
                                     "record its ranks' coordinates; each rank keeps its seeded state)")
            return
        own = tuple(checkpoint_state.rank_coordinates())
        table = {rank: own if rank == _rank() else (-1, -1, -1, -1) for rank in saved_ranks}
    saved = {int(rank): rng_mapping.RankCoordinates(*coordinates) for rank, coordinates in table.items()
             if int(rank) in saved_ranks}
    saved_args = common.get("args")
    sources = rng_mapping.stream_sources(
        saved, checkpoint_state.rank_coordinates(), bool(getattr(args, "data_parallel_random_init", False)),
        bool(getattr(saved_args, "data_parallel_random_init", False)))
    needed = sorted({source.saved_rank for source in sources if source.saved_rank is not None})
    objects = serialization.read_objects(directory, [f"{checkpoint_state.RNG_PREFIX}{rank}" for rank in needed],
                                         metadata=metadata)
    saved_states = {rank: objects[f"{checkpoint_state.RNG_PREFIX}{rank}"] for rank in needed}
    set_rng_state(rng_mapping.restored_state(rng_state(), saved_states, sources))
    outcomes = checkpoint_state.all_gather_objects([(source.group.name, source.saved_rank, source.reason)
                                                    for source in sources])
    restored, not_restored = rng_mapping.summarize(outcomes)
    if not not_restored:
        report.loaded.append("RNG state")
        return
    if restored:
        report.loaded.append("RNG state: " + "; ".join(restored))
    report.not_loaded.extend(f"RNG {phrase}" for phrase in not_restored)

"""`pretrain()`: Megatron's training driver.

initialize (flags, tokenizer, microbatch calculator, timers, process groups, seeds) -> model, optimizer,
scheduler -> checkpoint load -> data iterators -> train loop (one `train_step` per global batch: the pipeline
schedule runs forward/backward over the microbatches, then the optimizer and scheduler step) with periodic
evaluation (evaluation.py), checkpoints and logs;
stops at --train-iters, --exit-interval, --exit-duration-in-mins or SIGTERM (saving a checkpoint first when
--save is set). --skip-train evaluates instead of training; --iterations-to-skip drops chosen steps' batches;
--profile and --log-progress wrap the loop (profiling.py, progress_log.py).
"""

import dataclasses
import gc
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.datasets.gpt_dataset import check_data_files
from megatron.core.datasets.utils import blend_from_data_path
from megatron.core.enums import ModelType
from megatron.core.num_microbatches_calculator import (
    get_current_running_global_batch_size,
    get_num_microbatches,
    update_num_microbatches,
)
from megatron.core.fp8.scaling import reduce_fp8_amaxes
from megatron.core.optimizer.qk_clip import (
    clipping_after_step,
    max_attention_logit,
    reduce_max_attention_logits,
    reset_max_attention_logits,
)
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
from megatron.core.transformer.moe.router import reset_global_aux_loss_counts, update_expert_biases
from megatron.training import checkpoint_sources, checkpointing, moe_upcycling
from megatron.training.checkpoint_sources import non_persistent_save_dir
from megatron.training.datasets.sft_dataset import check_conversation_files
from megatron.training.data_iterators import (  # noqa: F401 (upstream's names in megatron.training.training)
    build_data_iterators,
    build_train_valid_test_data_iterators,
    cyclic_iter,
    get_train_valid_test_num_samples,
)
from megatron.training.energy_monitor import energy_not_counted
from megatron.training.evaluation import (  # noqa: F401 (re-exported)
    _evaluate,
    _timed_evaluation,
    _writer,
    evaluate,
    evaluate_at_the_end,
    evaluate_validation_sets,
    evaluate_without_training,
)
from megatron.training.global_batch import LOSS_NAME, loss_sums, reduce_reported_loss, run_schedule
from megatron.core.rerun_state_machine import destroy_rerun_state_machine, get_rerun_state_machine
from megatron.core.rerun_data_iterator import wrap_for_reruns
from megatron.core.timers import timed
from megatron.training.global_state import get_args, set_timers, timers_or_none
from megatron.training.initialize import initialize_megatron, set_up_microbatches, set_up_tokenizer
from megatron.training.manual_gc import ManualGarbageCollection
from megatron.training.model_setup import setup_model_and_optimizer
from megatron.training.non_loss_data import NO_HOOKS, NonLossDataHooks
from megatron.training.profiling import TrainingProfilers
from megatron.training.progress_log import (
    forget_progress_log,
    log_checkpoint_saved,
    start_progress_log,
    stop_progress_log,
)
from megatron.training.run_control import (
    ExitDuration,
    check_weight_hashes,
    empty_unused_memory,
    should_skip_step,
    skip_training_step,
    synchronize_at_interval,
    weight_hash_due,
)
from megatron.training.result_validation import (
    RejectedResultExit,
    check_step_may_continue,
    exit_after_rejected_result,
    load_rerun_state,
    validate_gradients,
)
from megatron.training.signal_handler import signal_handler_for_the_loop, uninstall_exit_signal_handler
from megatron.training.training_log import (
    TrainingLogger,
    counts_as_nan_iteration,
    memory_usage,
    reported_learning_rates,
)
from megatron.training.validation_sets import as_validation_sets

# Evaluation lives in evaluation.py and one global batch's schedule run and loss in global_batch.py; their names
# stay importable from here, as upstream's scripts and this repository's tests import them.
_loss_sums = loss_sums
_run_schedule = run_schedule


def _refuse_unsupported_pretrain_arguments(inprocess_call_wrapper):
    if inprocess_call_wrapper is not None:
        raise ValueError("pretrain(inprocess_call_wrapper=...) is not supported: there is no in-process restart; "
                         "drop inprocess_call_wrapper (pass extra_args_provider, args_defaults and the others by "
                         "keyword)")


def pretrain(
    train_valid_test_dataset_provider,
    model_provider,
    model_type,
    forward_step_func,
    process_non_loss_data_func=None,
    extra_args_provider=None,
    args_defaults={},
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    non_loss_data_func=None,
    store=None,
    inprocess_call_wrapper=None,
    *,
    argv=None,
):
    """Train a model end to end as the command line describes.

    `model_provider(pre_process, post_process)` builds this pipeline stage's model;
    `train_valid_test_dataset_provider([train, valid, test] sample counts)` returns three datasets (or None);
    `forward_step_func(data_iterator, model)` returns `(output, loss_func)`. `model_type` is a `ModelType`
    (or its name); only `ModelType.encoder_or_decoder` (decoder-only models) is supported. `argv` replaces
    `sys.argv[1:]` (tests). `get_embedding_ranks`, `get_position_embedding_ranks` and `store` go to
    `initialize_megatron()`, as upstream. The arguments are in upstream's order; `process_non_loss_data_func` and
    `non_loss_data_func` hand evaluation outputs other than the loss to a hook (non_loss_data.py);
    `inprocess_call_wrapper` (in-process restart) is refused when given. Returns the iteration training stopped at.
    """
    _refuse_unsupported_pretrain_arguments(inprocess_call_wrapper)
    non_loss_data = NonLossDataHooks(process_non_loss_data_func, non_loss_data_func)
    start_time = time.time()  # --exit-duration-in-mins counts from here (the earliest rank's start)
    model_type = resolve_model_type(model_type)
    args = initialize_megatron(extra_args_provider, args_defaults, args=argv, get_embedding_ranks=get_embedding_ranks,
                               get_position_embedding_ranks=get_position_embedding_ranks, store=store)
    try:
        non_loss_data.check_fits(args)
        args.train_start_time = start_time
        return _pretrain(train_valid_test_dataset_provider, model_provider, forward_step_func, args, non_loss_data)
    finally:
        _teardown(args)


def resolve_model_type(model_type):
    """`model_type` as a `ModelType`; accepts the member or its name, rejects anything unsupported."""
    if isinstance(model_type, str) and model_type in ModelType.__members__:
        model_type = ModelType[model_type]
    if model_type is not ModelType.encoder_or_decoder:
        raise ValueError(
            f"pretrain() trains ModelType.encoder_or_decoder models only, got {model_type!r}; pass "
            "megatron.core.enums.ModelType.encoder_or_decoder"
        )
    return model_type


def set_up_tokenizer_and_microbatches(args):
    """The tokenizer (made global, its vocabulary padded into `args.padded_vocab_size`) and the
    number-of-microbatches calculator, for a script that validated its arguments without `initialize_megatron()`
    (which sets both up, as `pretrain()` uses them)."""
    set_up_tokenizer(args)
    set_up_microbatches(args)


def _check_data_files_before_building(args):
    """Dataset prefixes (`--data-path` and the per-split paths) whose .bin / .idx files are missing (under --sft:
    JSON-lines files that are missing) stop the run before the model is built and a checkpoint loaded, with the
    message the dataset builder would give later."""
    if getattr(args, "mock_data", False) or getattr(args, "dataloader_type", None) == "external":
        return
    prefixes = []
    for paths in (getattr(args, name, None) for name in ("data_path", "train_data_path", "valid_data_path",
                                                          "test_data_path")):
        if paths:
            prefixes += blend_from_data_path(paths)[0]
    if prefixes and getattr(args, "sft", False):
        check_conversation_files(prefixes)
    elif prefixes:
        check_data_files(prefixes)


def _pretrain(train_valid_test_dataset_provider, model_provider, forward_step_func, args, non_loss_data=NO_HOOKS):
    checkpointing.check_checkpoint_format(args)
    _check_data_files_before_building(args)
    if getattr(args, "moe_use_upcycling", False):  # refused before the model is built
        moe_upcycling.check_sources(args)
    timers = timers_or_none()
    with timed(timers, "model-and-optimizer-setup", log_level=0, barrier=True):
        model, optimizer, scheduler, config = setup_model_and_optimizer(model_provider, args)
    config = _attach_timers(model, timers, args)

    args.consumed_train_samples = 0
    args.skipped_train_samples = 0  # --iterations-to-skip: the samples of the dropped batches (counted as consumed)
    args.iteration = 0
    if args.load is not None or getattr(args, "non_persistent_ckpt_type", None) == "local" or \
            getattr(args, "pretrained_checkpoint", None) is not None:  # local: with --load or without
        with timed(timers, "load-checkpoint", log_level=0, barrier=True):
            if args.moe_use_upcycling:  # --load is the dense checkpoint; the MoE one is written to --save and loaded
                args.iteration = moe_upcycling.upcycle_and_load(model, optimizer, scheduler, args)
            else:
                args.iteration = checkpointing.load_checkpoint(model, optimizer, scheduler, args)
        timers.log(["load-checkpoint"])
        if args.load is not None and not args.moe_use_upcycling:
            load_rerun_state(args.load, args.iteration)
    if getattr(args, "ckpt_convert_format", None) is not None:  # save the loaded checkpoint in it, then stop
        checkpointing.save_converted_checkpoint(args.iteration, model, optimizer, scheduler, args)
        return args.iteration
    get_rerun_state_machine().current_iteration = args.iteration
    if args.skip_train:  # no training data is read (a finished run's training samples are all consumed)
        train_valid_test_dataset_provider = _evaluation_splits_only(train_valid_test_dataset_provider)
    with timed(timers, "train/valid/test-data-iterators-setup", log_level=0, barrier=True):
        train_iterator, valid_iterator, test_iterator = build_data_iterators(train_valid_test_dataset_provider,
                                                                             args)
    timers.log(["model-and-optimizer-setup", "train/valid/test-data-iterators-setup"], barrier=True)

    logger = TrainingLogger(args, is_logging_rank=dist.get_rank() == dist.get_world_size() - 1, timers=timers)
    start_progress_log(args)
    try:
        if args.skip_train:
            iteration = evaluate_without_training(forward_step_func, model, valid_iterator, test_iterator, config,
                                                  logger, args, non_loss_data)
        else:
            iteration = train(forward_step_func, model, optimizer, scheduler, train_iterator, valid_iterator,
                              config, logger, args, non_loss_data=non_loss_data)
            if iteration >= args.train_iters and not args.stopped_early:
                evaluate_at_the_end(forward_step_func, model, valid_iterator, test_iterator, config, logger, args,
                                    non_loss_data)
        checkpointing.maybe_finalize_async_save(args, at_exit=True)  # a failed last save fails the run
        stop_progress_log(args, iteration)
    finally:
        logger.close()
    return iteration


def _teardown(args):
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.training.dist_checkpoint import forget_async_queue

    destroy_num_microbatches_calculator()
    forget_async_queue()
    destroy_rerun_state_machine()
    forget_progress_log()
    set_timers(None)
    uninstall_exit_signal_handler()  # the signal gets its previous action back once pretrain() returns
    if getattr(args, "created_process_group", False):
        # Sharded models hold reference cycles (wrapper <-> module <-> parameters, DTensor meshes) that keep
        # process groups alive; collect them while the groups can still shut down in order, not during
        # interpreter exit, where a gloo group's destructor aborts the process.
        gc.collect()
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# One iteration
# ---------------------------------------------------------------------------------------------------------


def train_step(forward_step_func, data_iterator, model, optimizer, scheduler, config, args, phase_range=None):
    """One global batch: forward/backward over all microbatches, then an optimizer step.

    Returns (reported loss, update_successful, grad_norm, num_zeros); the loss is None when the loss mask of the
    whole global batch was zero (no token to average; the log line leaves the iteration out of its mean). The
    forward-backward pass runs again (same data, same random state) when the rerun state machine asks, and
    `RejectedResultExit` is raised on every rank, before the optimizer step, when it stops training.
    `phase_range(name)` (--nvtx-ranges: the loop's `TrainingProfilers.phase_range`) wraps the `forward-backward`
    and `optimizer` phases.
    """
    phase_range = phase_range or _no_range
    timers = timers_or_none()
    machine = get_rerun_state_machine()
    data_iterator = wrap_for_reruns(data_iterator)
    while machine.should_run_forward_backward(data_iterator):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        reset_global_aux_loss_counts(model)  # MoE global_aux_loss: counts of this pass's microbatches only
        clear_aux_losses_tracker()  # MoE aux losses logged: this pass's only (a rerun replaces, not adds)
        if getattr(args, "qk_clip", False) or getattr(args, "log_max_attention_logit", False):
            reset_max_attention_logits(model)  # this pass's logits only
        with timed(timers, "forward-backward", log_level=1, barrier=args.barrier_with_L1_time), \
                phase_range("forward-backward"):
            losses_reduced = run_schedule(forward_step_func, data_iterator, model, args, forward_only=False)
        validate_gradients(model, args)
    check_step_may_continue()
    update_expert_biases(model)  # MoE aux-loss-free balancing: once per global batch
    empty_unused_memory(args, level=1)
    reduce_fp8_amaxes(model)  # delayed-scaling amaxes of all FP8 layers in one collective; step's FP8 weight caches
    if getattr(args, "qk_clip", False) or getattr(args, "log_max_attention_logit", False):
        reduce_max_attention_logits(model, parallel_state.get_data_parallel_group(with_context_parallel=True))
    qk_clipping = clipping_after_step(optimizer, model) if getattr(args, "qk_clip", False) else nullcontext()
    with timed(timers, "optimizer", log_level=1, barrier=args.barrier_with_L1_time), phase_range("optimizer"), \
            qk_clipping:
        update_successful, grad_norm, num_zeros = optimizer.step()
    empty_unused_memory(args, level=2)
    if update_successful:
        scheduler.step(increment=get_current_running_global_batch_size())
    loss = reduce_reported_loss(losses_reduced, args.device, without_tokens=None)
    return loss, update_successful, _as_float(grad_norm), _as_float(num_zeros)


def _no_range(name):
    return nullcontext()


def _as_float(value):
    if value is None:
        return None
    return float(value.item() if torch.is_tensor(value) else value)


# ---------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------


def _save(iteration, model, optimizer, scheduler, args):
    if args.save is None:
        return False
    timers = timers_or_none()
    with timed(timers, "save-checkpoint", log_level=0, barrier=True), energy_not_counted():
        checkpointing.save_checkpoint(iteration, model, optimizer, scheduler, args)
    if timers is not None:
        timers.log(["save-checkpoint"])
    log_checkpoint_saved(args, iteration)  # --log-progress
    if dist.get_rank() == 0 and getattr(args, "async_save", False):
        # The write goes on in the background; its own line says when the checkpoint is published (or not).
        print(f"scheduled a background save of iteration {iteration} to {args.save} (--async-save)", flush=True)
    elif dist.get_rank() == 0:
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        print(f"  successfully saved checkpoint from iteration {iteration:7d} to {args.save} "
              f"[ t 1/{tp_size}, p 1/{pp_size} ]", flush=True)
    return True


def _save_non_persistent(iteration, model, optimizer, scheduler, args):
    """--non-persistent-save-interval: save, timed and reported as upstream (the local type reports itself)."""
    timers = timers_or_none()
    with timed(timers, "save-checkpoint-non-persistent", log_level=0, barrier=True), energy_not_counted():
        checkpointing.save_non_persistent_checkpoint(iteration, model, optimizer, scheduler, args)
    if timers is not None:
        timers.log(["save-checkpoint-non-persistent"])
    if dist.get_rank() == 0 and getattr(args, "non_persistent_ckpt_type", None) != "local":
        print(f"  successfully saved non-persistent checkpoint from iteration {iteration:7d} to "
              f"{non_persistent_save_dir(args)}", flush=True)


def train(forward_step_func, model, optimizer, scheduler, train_iterator, valid_iterator, config, logger,
          args=None, non_loss_data=NO_HOOKS):
    """Run iterations from `args.iteration` to --train-iters; returns the last iteration reached."""
    args = args or get_args()
    for chunk in model:
        chunk.train()
    iteration = args.iteration
    args.stopped_early = False
    validation_sets = as_validation_sets(valid_iterator)
    # The loaded iteration is saved into --save at the end even when no iteration runs, unless it is already a
    # persistent checkpoint there: loaded from another directory (--load A --save B), or from a non-persistent
    # checkpoint (global or local) newer than --save's last one.
    last_saved_iteration = iteration if _saved_persistently(args, iteration) else None
    print_memory_on_this_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    exit_duration = ExitDuration(args.exit_duration_in_mins, getattr(args, "train_start_time", time.time()),
                                 args.device)
    if weight_hash_due(args, iteration):
        check_weight_hashes(model, iteration, args)
    with signal_handler_for_the_loop(args) as sigterm, ManualGarbageCollection.from_args(args) as manual_gc, \
            TrainingProfilers(args, dist.get_rank(), dist.get_world_size(), iteration, model) as profilers:
        if iteration < args.train_iters and sigterm.received_on_any_rank(args.device):  # during the set-up
            return _stop(f"received {args.exit_signal} before the first iteration", iteration, last_saved_iteration,
                         model, optimizer, scheduler, args)
        while iteration < args.train_iters:
            update_num_microbatches(args.consumed_train_samples)  # a --rampup-batch-size ramp moves with samples
            if should_skip_step(args, iteration):  # --iterations-to-skip: drop the batch, as upstream, no checks
                skip_training_step(train_iterator, get_num_microbatches())
                iteration += 1
                args.iteration = iteration
                args.consumed_train_samples += get_current_running_global_batch_size()
                args.skipped_train_samples = (getattr(args, "skipped_train_samples", 0)
                                              + get_current_running_global_batch_size())
                profilers.after_step(iteration)
                if dist.get_rank() == 0:
                    print(f"iteration {iteration} skipped (--iterations-to-skip): its global batch was dropped",
                          flush=True)
                continue
            start = time.perf_counter()
            try:
                with profilers.step_range(iteration):  # --profile, --nvtx-ranges
                    loss, update_successful, grad_norm, num_zeros = train_step(
                        forward_step_func, train_iterator, model, optimizer, scheduler, config, args,
                        phase_range=profilers.phase_range,
                    )
            except RejectedResultExit as stop:
                exit_after_rejected_result(
                    stop, iteration, last_saved_iteration,
                    lambda at: _save(at, model, optimizer, scheduler, args), args,
                )  # fmt: skip
            _synchronize(args.device)
            iteration_time_s = time.perf_counter() - start
            iteration += 1
            args.iteration = iteration
            synchronize_at_interval(args, iteration)  # --train-sync-interval
            args.consumed_train_samples += get_current_running_global_batch_size()
            manual_gc.after_iteration(iteration)
            profilers.after_step(iteration)
            learning_rate, decoupled_learning_rate = reported_learning_rates(optimizer.param_groups)
            logger.log_iteration(
                {
                    "iteration": iteration,
                    "rank": dist.get_rank(),
                    "losses": {LOSS_NAME: loss},
                    "learning_rate": learning_rate,
                    "decoupled_learning_rate": decoupled_learning_rate,
                    "loss_scale": float(optimizer.get_loss_scale()),
                    "grad_norm": grad_norm,
                    "num_zeros": num_zeros,
                    "params_norm": calc_params_norm(optimizer) if args.log_params_norm else None,
                    "max_attention_logit": (max_attention_logit(model, parallel_state.get_model_parallel_group())
                                            if getattr(args, "log_max_attention_logit", False) else None),
                    "skipped": not update_successful,
                    "nan": counts_as_nan_iteration(loss, skipped=not update_successful),
                    "iteration_time_s": iteration_time_s,
                    "consumed_samples": args.consumed_train_samples,
                    "skipped_samples": getattr(args, "skipped_train_samples", 0),
                    "global_batch_size": get_current_running_global_batch_size(),
                    # Computed only when this iteration reports it (log line, metrics record, TensorBoard).
                    "memory": lambda: memory_usage(model, optimizer, args.device),
                    "print_memory_on_this_rank": print_memory_on_this_rank,
                }
            )
            if validation_sets and args.eval_iters > 0 and iteration % args.eval_interval == 0:
                manual_gc.around_evaluation_step()
                with energy_not_counted():  # --log-energy: training steps only
                    evaluate_validation_sets(forward_step_func, validation_sets, model, config, logger, iteration,
                                             args, exit_duration, non_loss_data=non_loss_data)
                manual_gc.around_evaluation_step()
            checkpointing.maybe_finalize_async_save(args)
            if weight_hash_due(args, iteration):
                check_weight_hashes(model, iteration, args)
            if args.save_interval and iteration % args.save_interval == 0:
                if _save(iteration, model, optimizer, scheduler, args):
                    last_saved_iteration = iteration
            elif checkpointing.non_persistent_save_due(args, iteration):
                _save_non_persistent(iteration, model, optimizer, scheduler, args)
            stop_reason = None
            if sigterm.received_on_any_rank(args.device):
                stop_reason = f"received {args.exit_signal}"
            elif exit_duration.reached():
                stop_reason = f"reached --exit-duration-in-mins {args.exit_duration_in_mins}"
            elif args.exit_interval and iteration % args.exit_interval == 0:
                stop_reason = f"reached --exit-interval {args.exit_interval}"
            if stop_reason is not None:
                return _stop(stop_reason, iteration, last_saved_iteration, model, optimizer, scheduler, args)
    if last_saved_iteration != iteration and iteration > 0:
        _save(iteration, model, optimizer, scheduler, args)
    return iteration


def _stop(reason, iteration, last_saved_iteration, model, optimizer, scheduler, args):
    """Stop before --train-iters: save the iteration reached (with --save, unless saved already or untrained)."""
    if last_saved_iteration != iteration and iteration > 0:
        _save(iteration, model, optimizer, scheduler, args)
    if dist.get_rank() == 0:
        print(f"exiting at iteration {iteration}: {reason}", flush=True)
    args.stopped_early = True
    return iteration


def _saved_persistently(args, iteration) -> bool:
    """Whether `iteration`, just loaded, is a persistent checkpoint of --save (True without --save)."""
    if args.load is None:
        return False
    if args.save is None:
        return True
    return (os.path.realpath(args.load) == os.path.realpath(args.save)
            and iteration in checkpoint_sources.checkpoint_iterations(args.save))


def _evaluation_splits_only(train_valid_test_dataset_provider):
    def provide(num_samples):
        _, valid_dataset, test_dataset = train_valid_test_dataset_provider(num_samples)
        return None, valid_dataset, test_dataset

    return provide


def calc_params_norm(optimizer):
    """The global L2 norm of the optimizer's main parameters (--log-params-norm): every element counted once
    over tensor-, pipeline-, data- and expert-parallel ranks, as for the gradient norm."""
    return optimizer.global_norm(lambda param: param.detach())


def _attach_timers(model, timers, args):
    """Hand the run's timers to the schedules, `finalize_model_grads` and the data-parallel wrappers through each
    chunk's config (which they read); returns the first chunk's config."""
    for chunk in model:
        chunk.config = dataclasses.replace(chunk.config, timers=timers, barrier_with_L1_time=args.barrier_with_L1_time)
    return model[0].config


def _synchronize(device):
    from megatron.training.accelerator import synchronize

    synchronize(device)

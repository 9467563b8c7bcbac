"""Evaluation: the loss over --eval-iters global batches (or a whole validation set with --full-validation),
timed and logged per validation set, during training, after its last iteration and with --skip-train.

An evaluation batch is always a full --global-batch-size batch, also during a --rampup-batch-size ramp (as
upstream): the validation and test sample counts the datasets are built for (data_iterators.py) count full
batches, and losses at different points of the ramp stay comparable.
"""

import dataclasses

import torch
import torch.distributed as dist

from megatron.core.timers import timed
from megatron.training.global_batch import LOSS_NAME, loss_sums, reduce_reported_loss, run_schedule
from megatron.training.global_state import get_tensorboard_writer, timers_or_none
from megatron.training.non_loss_data import NO_HOOKS, collect_non_loss_data, process_non_loss_data
from megatron.training.result_validation import pause_result_validation, resume_result_validation
from megatron.training.run_control import empty_unused_memory
from megatron.training.validation_sets import as_validation_sets


def evaluation_num_microbatches(args):
    """Microbatches of one evaluation batch: --global-batch-size / (--micro-batch-size x data-parallel size),
    whatever the training batch size is during a --rampup-batch-size ramp."""
    return args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)


def evaluate(forward_step_func, data_iterator, model, config, args, exit_duration=None, num_batches=None):
    """Mean validation loss over `num_batches` (default --eval-iters) global batches (no gradients). Once
    `exit_duration` (--exit-duration-in-mins) is reached it stops, on every rank together, and returns None when
    batches were left: as upstream, a loss over part of the batches is not reported."""
    return _evaluate(forward_step_func, data_iterator, model, args, exit_duration, num_batches)[0]


def _evaluate(forward_step_func, data_iterator, model, args, exit_duration=None, num_batches=None,
              non_loss_data=NO_HOOKS):
    """(`evaluate`'s losses, the non-loss data collected after them: None unless `non_loss_data` collects and
    the evaluation was not cut short)."""
    collected = None
    for chunk in model:
        chunk.eval()
    validation_mode = pause_result_validation()
    total = torch.zeros(2, dtype=torch.float64, device=args.device)
    num_microbatches = evaluation_num_microbatches(args)
    # As upstream, the evaluation's forward steps are not timed: the schedule's level-2 timers (forward-compute,
    # pipeline transfers) would otherwise add them to the next training log line's.
    timed_configs = {index: chunk.config for index, chunk in enumerate(model)
                     if getattr(getattr(chunk, "config", None), "timers", None) is not None}
    try:
        for index, config_of_chunk in timed_configs.items():
            model[index].config = dataclasses.replace(config_of_chunk, timers=None)
        batches = args.eval_iters if num_batches is None else num_batches
        cut_short = False
        with torch.no_grad():
            for done in range(1, batches + 1):
                losses_reduced = run_schedule(forward_step_func, data_iterator, model, args, forward_only=True,
                                              num_microbatches=num_microbatches)
                total += loss_sums(losses_reduced, args.device)
                empty_unused_memory(args, level=1)
                if exit_duration is not None and exit_duration.reached():
                    cut_short = done < batches
                    break
            if not cut_short:
                collected = collect_non_loss_data(non_loss_data, model, lambda **collect: run_schedule(
                    forward_step_func, data_iterator, model, args, forward_only=True,
                    num_microbatches=num_microbatches, **collect))
    finally:
        for index, config_of_chunk in timed_configs.items():
            model[index].config = config_of_chunk
    resume_result_validation(validation_mode)
    for chunk in model:
        chunk.train()
    if cut_short:
        if dist.get_rank() == 0:
            print(f"evaluation stopped after {done} of {batches} batches: reached --exit-duration-in-mins "
                  f"{args.exit_duration_in_mins}; its loss is not reported", flush=True)
        return None, None
    # Reuse the training reduction on a single synthetic report holding the accumulated sums.
    return {LOSS_NAME: reduce_reported_loss([{LOSS_NAME: total}], args.device)}, collected


def evaluate_validation_sets(forward_step_func, validation_sets, model, config, logger, iteration, args,
                             exit_duration=None, where=None, non_loss_data=NO_HOOKS):
    """Evaluate and log each validation set (validation_sets.py): one "validation loss" block per set, then its
    non-loss data to `process_non_loss_data_func` (non_loss_data.py); the sets left once
    --exit-duration-in-mins cuts an evaluation short are neither evaluated nor logged."""
    for validation_set in validation_sets:
        iterator, num_batches = validation_set.next_evaluation(args.eval_iters, args.global_batch_size)
        losses, collected = _timed_evaluation(forward_step_func, iterator, model, config, args, exit_duration,
                                              num_batches, non_loss_data)
        if losses is None:
            return
        logger.log_evaluation(iteration, losses, set_label=validation_set.label, where=where,
                              write_to_tensorboard=not args.skip_train)
        process_non_loss_data(non_loss_data, collected, iteration, _writer(args))


def _writer(args):
    """The TensorBoard writer evaluations write to (None with --skip-train, as upstream)."""
    return None if args.skip_train else get_tensorboard_writer()


def _timed_evaluation(forward_step_func, iterator, model, config, args, exit_duration=None, num_batches=None,
                      non_loss_data=NO_HOOKS):
    """`_evaluate` under the level-0 "evaluate" timer, logged after each evaluation as upstream (collective)."""
    timers = timers_or_none()
    with timed(timers, "evaluate", log_level=0, barrier=True):
        losses, collected = _evaluate(forward_step_func, iterator, model, args, exit_duration, num_batches,
                                      non_loss_data)
    if timers is not None:
        timers.log(["evaluate"])
    return losses, collected


def evaluate_at_the_end(forward_step_func, model, valid_iterator, test_iterator, config, logger, args,
                        non_loss_data=NO_HOOKS):
    """After the last training iteration (not after an early exit), as upstream: one more evaluation of each
    validation set and one of the test set (those that exist, --eval-iters batches each, or whole with
    --full-validation), logged "... loss at iteration N on validation set" / "... on test set"."""
    if args.eval_iters <= 0:
        return
    evaluate_validation_sets(forward_step_func, as_validation_sets(valid_iterator), model, config, logger,
                             args.iteration, args, where="on validation set", non_loss_data=non_loss_data)
    if test_iterator is not None:
        losses, collected = _timed_evaluation(forward_step_func, test_iterator, model, config, args,
                                              non_loss_data=non_loss_data)
        logger.log_evaluation(args.iteration, losses, prefix="test", where="on test set")
        process_non_loss_data(non_loss_data, collected, args.iteration, _writer(args))


def evaluate_without_training(forward_step_func, model, valid_iterator, test_iterator, config, logger, args,
                              non_loss_data=NO_HOOKS):
    """--skip-train: evaluate the model as loaded once on the validation set(s) and the test set (those that
    exist, --eval-iters batches each, or whole with --full-validation), log it at `args.iteration`, and return
    that iteration."""
    iteration = args.iteration
    if dist.get_rank() == 0:
        print(f"--skip-train: evaluating at iteration {iteration} without training", flush=True)
    validation_sets = as_validation_sets(valid_iterator)
    if not validation_sets and test_iterator is None and dist.get_rank() == 0:
        print("WARNING: --skip-train: there is no validation or test data to evaluate (see --split or "
              "--valid-data-path / --test-data-path), so nothing was evaluated", flush=True)
    if args.eval_iters > 0:
        # As upstream: "... on validation set" / "... on test set", and nothing written to TensorBoard.
        evaluate_validation_sets(forward_step_func, validation_sets, model, config, logger,
                                 iteration, args, where="on validation set", non_loss_data=non_loss_data)
        if test_iterator is not None:
            losses, _ = _timed_evaluation(forward_step_func, test_iterator, model, config, args,
                                          non_loss_data=non_loss_data)
            logger.log_evaluation(iteration, losses, prefix="test", where="on test set", write_to_tensorboard=False)
    return iteration

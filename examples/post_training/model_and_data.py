"""What the post-training examples (quantize.py, prune.py) share with pretrain(): setting up the tokenizer and
micro-batches, building pretrain_gpt's model, and forward passes over global batches of the training split
(calibration) and the validation split (the loss before and after), outside a training step."""

import sys

import torch

import pretrain_gpt
from megatron.training import checkpointing


def setup_tokenizer_and_batches(args):
    """What pretrain() does before building a model and reading data, beyond what `initialize_megatron()` (in
    `run_with_megatron`) already set up (the tokenizer, the padded vocabulary size, with --use-checkpoint-args the
    checkpoint's, and the micro-batch calculator): checking the checkpoint format flags."""
    checkpointing.check_checkpoint_format(args)


def build_model(args):
    """This stage's GPT model as pretrain_gpt.py builds it, not wrapped for data parallelism (post-training runs
    forward passes only)."""
    from megatron.training.model_setup import get_model

    return get_model(pretrain_gpt.model_provider, args, wrap_with_ddp=False)[0]


def modelopt_modes(model):
    """The modelopt modes `model` was converted with (e.g. ['quantize', 'max_calibrate'] for a checkpoint written
    by quantize.py); empty for a model modelopt did not convert."""
    if "modelopt" not in sys.modules:  # only a process that imported modelopt can hold a model it converted
        return []
    import modelopt.torch.opt as mto

    from megatron.core.distributed.data_parallel_base import unwrap_model

    module = unwrap_model(model)
    if not mto.ModeloptStateManager.is_converted(module):
        return []
    return [mode.name for mode, _, _ in mto.ModeloptStateManager(module).modes_with_states()]


def run_global_batches(model, data_iterator, num_batches, args):
    """Forward `num_batches` global batches; returns the token-weighted mean loss (None off the last stage)."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.training.result_validation import pause_result_validation, resume_result_validation
    from megatron.training.training import reduce_reported_loss

    total = []
    model.eval()
    validation_mode = pause_result_validation()  # forward passes outside a training step, as in evaluation
    with torch.no_grad():
        for _ in range(num_batches):
            total += get_forward_backward_func()(
                forward_step_func=pretrain_gpt.forward_step,
                data_iterator=data_iterator,
                model=[model],
                num_microbatches=get_num_microbatches(),
                seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size,
                decoder_seq_length=args.seq_length,
                forward_only=True,
            )
    resume_result_validation(validation_mode)
    return float(reduce_reported_loss(total, args.device))


def data_iterators(args):
    """(training, validation) iterators from the start of their splits."""
    from megatron.training.data_iterators import build_data_iterators

    # Calibration and validation read their splits from the start, whatever the checkpoint had consumed.
    args.consumed_train_samples, args.iteration = 0, 0
    train_iterator, valid_iterator, _ = build_data_iterators(pretrain_gpt.train_valid_test_datasets_provider, args)
    if train_iterator is None or valid_iterator is None:
        raise ValueError("calibration and validation need training and validation data (--data-path, and --split "
                         "with a validation part)")
    return train_iterator, valid_iterator


def validation_loss(model, args):
    """Mean loss over --eval-iters global batches of validation data, always the same batches."""
    _, valid_iterator = data_iterators(args)
    return run_global_batches(model, valid_iterator, args.eval_iters, args)


def global_batches_phrase(count: int) -> str:
    """How the result lines name the number of global batches they ran ("1 global batch", "8 global batches")."""
    return f"{count} global batch" + ("" if count == 1 else "es")


def run_with_megatron(extra_args_provider, run, argv=None):
    """`run(args)` with Megatron initialised from `argv` (plus the script's own arguments), torn down after."""
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import _teardown

    args = initialize_megatron(extra_args_provider=extra_args_provider, args=argv)
    try:
        return run(args)
    finally:
        _teardown(args)

"""Optimisation flags: batch sizes, iterations, learning-rate schedule, optimizer, precision, recompute.

Training length and the learning-rate schedule are counted in iterations (--train-iters, --lr-*-iters) or in
samples (--train-samples, --lr-*-samples), never a mix, as upstream.
"""

import dataclasses
import warnings

from megatron.core.num_microbatches_calculator import rampup_train_iters, running_global_batch_size


def add_arguments(parser):
    group = parser.add_argument_group("training")
    group.add_argument("--micro-batch-size", type=int, default=None, help="Samples per micro-batch per rank.")
    group.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Samples per optimizer step over all data-parallel ranks; default micro-batch x data-parallel size.",
    )
    group.add_argument("--train-iters", type=int, default=None,
                       help="Number of optimizer steps to train for (exclusive with --train-samples).")
    group.add_argument("--train-samples", type=int, default=None,
                       help="Number of samples to train for: --train-samples // --global-batch-size iterations; the "
                       "learning-rate schedule is then given in samples (--lr-decay-samples, --lr-warmup-samples).")
    group.add_argument("--rampup-batch-size", nargs="*", default=None,
                       help="<start global batch size> <increment> <ramp-up samples>: grow the global batch from the "
                       "start by the increment in equal sample steps until the ramp-up samples are consumed, then "
                       "keep --global-batch-size (sample-based training only).")
    group.add_argument("--decrease-batch-size-if-needed", action="store_true",
                       help="A global batch size (--global-batch-size, or a step of --rampup-batch-size) that is not "
                       "a multiple of --micro-batch-size x data-parallel size runs as the largest multiple below it "
                       "instead of being an error, e.g. to keep training on fewer data-parallel ranks; relaunching "
                       "with a data-parallel size that divides it restores the full size.")
    group.add_argument("--exit-interval", type=int, default=None,
                       help="Exit after an iteration divisible by this (0: never, as upstream).")
    group.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="On --exit-signal (SIGTERM by default), every rank saves a checkpoint (with --save) at the end of "
        "the iteration and exits. Without it the signal keeps its default action, as upstream.",
    )
    group.add_argument("--exit-signal", default="SIGTERM", choices=["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"],
                       help="With --exit-signal-handler, the signal that makes every rank save a checkpoint (with "
                       "--save) at the end of the iteration and exit, e.g. SIGUSR1 for a scheduler's warning "
                       "signal before SIGTERM.")
    group.add_argument("--lr", type=float, default=None, help="Peak learning rate.")
    group.add_argument("--min-lr", type=float, default=0.0, help="Learning rate at the end of decay.")
    group.add_argument("--decoupled-lr", type=float, default=None,
                       help="Peak learning rate of the word-embedding and output-layer weights (same schedule).")
    group.add_argument("--decoupled-min-lr", type=float, default=None,
                       help="Their learning rate at the end of decay; default --min-lr. Needs --decoupled-lr.")
    group.add_argument("--lr-decay-style", default="linear",
                       choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                       help="Decay after warm-up; WSD (warmup-stable-decay) holds --lr until the last "
                       "--lr-wsd-decay-iters/-samples of the decay, then anneals with --lr-wsd-decay-style.")
    group.add_argument("--lr-wsd-decay-style", default=None,
                       choices=["exponential", "linear", "cosine", "minus_sqrt"],
                       help="Shape of the WSD anneal (default exponential).")
    group.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                       help="Iterations of the WSD anneal (iteration-based training).")
    group.add_argument("--lr-wsd-decay-samples", type=int, default=None,
                       help="Samples of the WSD anneal (sample-based training).")
    group.add_argument("--lr-warmup-iters", type=int, default=0, help="Linear warm-up steps.")
    group.add_argument("--lr-warmup-samples", type=int, default=0,
                       help="Linear warm-up in samples (sample-based training).")
    group.add_argument("--lr-decay-samples", type=int, default=None,
                       help="Decay length in samples (sample-based training); default --train-samples.")
    group.add_argument(
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="Warm up over this fraction of --lr-decay-iters instead of --lr-warmup-iters (exclusive with it).",
    )
    group.add_argument("--lr-warmup-init", type=float, default=0.0, help="Learning rate at the start of warm-up.")
    group.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        action="store_true",
        help="On --load, take the learning-rate / weight-decay schedule from the checkpoint, ignoring the flags.",
    )
    group.add_argument(
        "--override-opt_param-scheduler",
        action="store_true",
        help="On --load, keep the schedule the flags give, ignoring the checkpoint's. With neither flag a "
        "checkpoint whose schedule differs from the flags is an error.",
    )
    group.add_argument("--lr-decay-iters", type=int, default=None, help="Decay steps; default --train-iters.")
    group.add_argument("--weight-decay", type=float, default=0.01, help="Decoupled weight decay.")
    group.add_argument("--no-weight-decay-cond-type", default=None, choices=["apply_wd_to_qk_layernorm"],
                       help="Which parameters skip weight decay. Unset: biases, 1-D parameters (norms) and, with "
                       "--embedding-init-method-std, the embeddings. apply_wd_to_qk_layernorm (Qwen3-Next): the same, "
                       "except that the query / key norm weights (--qk-layernorm) are decayed.")
    group.add_argument("--start-weight-decay", type=float, default=None,
                       help="Weight decay at the first step of an increasing schedule (needs --end-weight-decay "
                       "and --weight-decay-incr-style linear or cosine); default --weight-decay.")
    group.add_argument("--end-weight-decay", type=float, default=None,
                       help="Weight decay at the last step (--train-iters) of that schedule; default --weight-decay.")
    group.add_argument("--weight-decay-incr-style", default="constant", choices=["constant", "linear", "cosine"],
                       help="How weight decay goes from --start-weight-decay to --end-weight-decay.")
    group.add_argument("--manual-gc", action="store_true",
                       help="Turn off Python's automatic garbage collector during training and collect every "
                       "--manual-gc-interval iterations instead, on all ranks at the same step (so no rank "
                       "stalls the others at a random moment).")
    group.add_argument("--manual-gc-interval", type=int, default=0,
                       help="Iterations between collections with --manual-gc; 0 collects only at the start, "
                       "around evaluation and at the end.")
    group.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                       help="With --manual-gc, do not collect at the start and end of each evaluation.")
    group.add_argument("--clip-grad", type=float, default=1.0, help="Global gradient-norm clip (0 disables).")
    group.add_argument("--optimizer", default="adam", choices=["adam", "sgd", "muon"])
    group.add_argument("--adam-beta1", type=float, default=0.9)
    group.add_argument("--adam-beta2", type=float, default=0.999)
    group.add_argument("--adam-eps", type=float, default=1e-8)
    group.add_argument("--sgd-momentum", type=float, default=0.9)
    group.add_argument("--seed", type=int, default=1234, help="Random seed of initialisation and dropout.")
    group.add_argument(
        "--deterministic-mode",
        action="store_true",
        help="torch.use_deterministic_algorithms(True): ops without a deterministic kernel raise instead of "
        "running (on GPU CUBLAS_WORKSPACE_CONFIG=:4096:8 is set when unset). fp32 CPU runs with gloo are "
        "deterministic without it.",
    )
    group.add_argument("--bf16", action="store_true", help="bfloat16 model parameters (fp32 main copies).")
    group.add_argument("--fp16", action="store_true", help="float16 model parameters with loss scaling.")
    group.add_argument("--loss-scale", type=float, default=None, help="Static loss scale (fp16); default dynamic.")
    group.add_argument("--initial-loss-scale", type=float, default=2.0**32, help="Start of the dynamic loss scale.")
    group.add_argument("--min-loss-scale", type=float, default=1.0, help="Floor of the dynamic loss scale.")
    group.add_argument("--loss-scale-window", type=int, default=1000, help="Steps between loss-scale increases.")
    group.add_argument("--hysteresis", type=int, default=2, help="Overflows tolerated before lowering the scale.")
    group.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    group.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    group.add_argument("--recompute-num-layers", type=int, default=None)
    group.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="Average the loss over all tokens of the global batch instead of per micro-batch.",
    )


def validate(args):
    if args.micro_batch_size is None or args.micro_batch_size <= 0:
        raise ValueError("--micro-batch-size is required and must be positive")
    samples_per_pass = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = samples_per_pass
    if args.decrease_batch_size_if_needed and args.global_batch_size > 0:
        _decrease_global_batch_size(args, samples_per_pass)
    elif args.global_batch_size <= 0 or args.global_batch_size % samples_per_pass != 0:
        raise ValueError(
            f"--global-batch-size ({args.global_batch_size}) must be a positive multiple of --micro-batch-size "
            f"({args.micro_batch_size}) x data-parallel size ({args.data_parallel_size}) = {samples_per_pass}"
        )
    _validate_training_length(args)
    if args.exit_interval is not None and args.exit_interval < 0:
        raise ValueError(f"--exit-interval must be positive (0 turns it off), got {args.exit_interval}")
    if args.exit_interval == 0:
        args.exit_interval = None  # upstream's 0: no exit interval
    if args.exit_signal != "SIGTERM" and not args.exit_signal_handler:
        warnings.warn(f"--exit-signal {args.exit_signal} takes effect with --exit-signal-handler only: add it to "
                      "save a checkpoint and exit on that signal")
    if args.lr is None:
        raise ValueError("--lr is required")
    for flag, value in (("--lr", args.lr), ("--min-lr", args.min_lr)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr ({args.min_lr}) must not exceed --lr ({args.lr})")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        raise ValueError("--decoupled-min-lr needs --decoupled-lr")
    if args.decoupled_lr is not None and args.decoupled_lr < 0:
        raise ValueError(f"--decoupled-lr must be >= 0, got {args.decoupled_lr}")
    if args.decoupled_min_lr is not None and not 0 <= args.decoupled_min_lr <= args.decoupled_lr:
        raise ValueError(f"--decoupled-min-lr ({args.decoupled_min_lr}) must be in [0, --decoupled-lr "
                         f"({args.decoupled_lr})]")
    if args.train_samples is None:
        _validate_iteration_schedule(args)
    else:
        _validate_sample_schedule(args)
    _validate_weight_decay_schedule(args)
    if args.manual_gc_interval < 0:
        raise ValueError(f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}")
    if args.manual_gc_interval and not args.manual_gc:
        raise ValueError("--manual-gc-interval needs --manual-gc")
    if args.use_checkpoint_opt_param_scheduler and args.override_opt_param_scheduler:
        raise ValueError(
            "--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler are exclusive: pick one"
        )
    if not 0.0 <= args.lr_warmup_init <= args.lr:
        raise ValueError(f"--lr-warmup-init ({args.lr_warmup_init}) must be in [0, --lr ({args.lr})]")
    if args.bf16 and args.fp16:
        raise ValueError("--bf16 and --fp16 are exclusive: pick one")
    if args.clip_grad < 0:
        raise ValueError(f"--clip-grad must be >= 0, got {args.clip_grad}")
    if args.seed <= 0:
        raise ValueError(f"--seed must be a positive integer (as upstream), got {args.seed}")
    _validate_optimizer_settings(args)
    if args.recompute_method is not None and args.recompute_granularity != "full":
        raise ValueError("--recompute-method needs --recompute-granularity full")
    if args.recompute_granularity == "full" and args.recompute_method is None:
        raise ValueError("--recompute-granularity full needs --recompute-method {uniform,block}")
    if args.recompute_method is not None and args.recompute_num_layers is None:
        raise ValueError("--recompute-method needs --recompute-num-layers")
    if args.recompute_num_layers is not None and args.recompute_method is None:
        raise ValueError("--recompute-num-layers needs --recompute-method")
    args.params_dtype_name = "bf16" if args.bf16 else ("fp16" if args.fp16 else "fp32")


def _validate_optimizer_settings(args):
    """OptimizerConfig's rules on the optimizer and loss-scaler flags, named by flag and checked before start-up
    (the loss-scaler settings matter with --fp16 only, but are checked in every run, as OptimizerConfig does)."""
    if args.weight_decay < 0:
        raise ValueError(f"--weight-decay must be >= 0, got {args.weight_decay}")
    for flag, value in (("--adam-beta1", args.adam_beta1), ("--adam-beta2", args.adam_beta2),
                        ("--sgd-momentum", args.sgd_momentum)):
        if not 0 <= value < 1:
            raise ValueError(f"{flag} must be in [0, 1), got {value}")
    if args.adam_eps <= 0:
        raise ValueError(f"--adam-eps must be positive, got {args.adam_eps}")
    if args.loss_scale is not None and args.loss_scale <= 0:
        raise ValueError(f"--loss-scale is a static loss scale and must be positive, got {args.loss_scale}; leave it "
                         "out for dynamic loss scaling")
    if not 0 < args.min_loss_scale <= args.initial_loss_scale:
        raise ValueError(f"need 0 < --min-loss-scale ({args.min_loss_scale}) <= --initial-loss-scale "
                         f"({args.initial_loss_scale})")
    for flag, value in (("--loss-scale-window", args.loss_scale_window), ("--hysteresis", args.hysteresis)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")


def _decrease_global_batch_size(args, samples_per_pass):
    """--decrease-batch-size-if-needed. A ramp keeps its sizes (the calculator decreases each step); a constant
    global batch becomes its running size here, so the iteration count and the schedule count what steps run."""
    running = running_global_batch_size(args.global_batch_size, samples_per_pass, "--global-batch-size")
    if args.rampup_batch_size is not None or running == args.global_batch_size:
        return
    if args.rank == 0:
        print(f"--decrease-batch-size-if-needed: --global-batch-size {args.global_batch_size} is not a multiple of "
              f"--micro-batch-size x data-parallel size ({samples_per_pass}); running {running} samples per step",
              flush=True)
    args.global_batch_size = running


def _validate_weight_decay_schedule(args):
    if args.weight_decay_incr_style == "constant":
        for flag, value in (("--start-weight-decay", args.start_weight_decay),
                            ("--end-weight-decay", args.end_weight_decay)):
            if value is not None and value != args.weight_decay:
                raise ValueError(f"{flag} ({value}) differs from --weight-decay ({args.weight_decay}) with "
                                 "--weight-decay-incr-style constant: pass --weight-decay-incr-style linear or "
                                 "cosine, or drop it")
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
        return
    if args.start_weight_decay is None or args.end_weight_decay is None:
        raise ValueError(f"--weight-decay-incr-style {args.weight_decay_incr_style} needs --start-weight-decay and "
                         "--end-weight-decay")
    for flag, value in (("--start-weight-decay", args.start_weight_decay),
                        ("--end-weight-decay", args.end_weight_decay)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    if args.start_weight_decay > args.end_weight_decay:
        raise ValueError(f"--start-weight-decay ({args.start_weight_decay}) must not exceed --end-weight-decay "
                         f"({args.end_weight_decay}): the schedule only increases")


def _validate_training_length(args):
    """Upstream's two modes: --train-iters with iteration-counted schedules, or --train-samples with
    sample-counted ones; each excludes the other's flags."""
    if args.train_iters is not None and args.train_samples is not None:
        raise ValueError("--train-iters and --train-samples are exclusive: pick one")
    if args.train_samples is None:
        if args.train_iters is None or args.train_iters <= 0:
            raise ValueError("--train-iters (or --train-samples) is required and must be positive")
        if args.rampup_batch_size is not None:
            raise ValueError("--rampup-batch-size needs sample-based training: use --train-samples (and the "
                             "--lr-*-samples flags) instead of --train-iters")
        for flag, value, unset in (("--lr-decay-samples", args.lr_decay_samples, None),
                                   ("--lr-warmup-samples", args.lr_warmup_samples, 0),
                                   ("--lr-wsd-decay-samples", args.lr_wsd_decay_samples, None)):
            if value != unset:
                raise ValueError(f"{flag} needs sample-based training (--train-samples); with --train-iters use "
                                 f"{flag.replace('samples', 'iters')}")
        return
    if args.train_samples <= 0:
        raise ValueError(f"--train-samples must be positive, got {args.train_samples}")
    for flag, value, unset in (("--lr-decay-iters", args.lr_decay_iters, None),
                               ("--lr-warmup-iters", args.lr_warmup_iters, 0),
                               ("--lr-wsd-decay-iters", args.lr_wsd_decay_iters, None)):
        if value != unset:
            raise ValueError(f"{flag} needs iteration-based training (--train-iters); with --train-samples use "
                             f"{flag.replace('iters', 'samples')}")
    if args.rampup_batch_size is None:
        args.train_iters = args.train_samples // args.global_batch_size
    else:
        args.rampup_batch_size = _rampup_values(args.rampup_batch_size)
        args.train_iters = rampup_train_iters(args.train_samples, args.global_batch_size, args.micro_batch_size,
                                              args.data_parallel_size, args.rampup_batch_size,
                                              args.decrease_batch_size_if_needed)
    if args.train_iters == 0:
        raise ValueError(f"--train-samples ({args.train_samples}) is less than one --global-batch-size "
                         f"({args.global_batch_size})")


def _rampup_values(values):
    try:
        start, increment, samples = (int(value) for value in values)
    except ValueError:
        raise ValueError(f"--rampup-batch-size takes three integers <start> <increment> <ramp-up samples>, got "
                         f"{' '.join(map(str, values))!r}") from None
    return start, increment, samples


def _validate_iteration_schedule(args):
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_decay_iters <= 0:
        raise ValueError(f"--lr-decay-iters must be positive, got {args.lr_decay_iters}")
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_iters != 0:
            raise ValueError("--lr-warmup-fraction and --lr-warmup-iters are exclusive: pick one")
        _check_warmup_fraction(args)
        # Counted in samples like upstream (fraction x decay samples), so it need not be a whole iteration.
        args.lr_warmup_iters = args.lr_warmup_fraction * args.lr_decay_iters
    if args.lr_warmup_iters < 0 or args.lr_warmup_iters >= args.lr_decay_iters:
        raise ValueError(
            f"--lr-warmup-iters ({args.lr_warmup_iters}) must be in [0, --lr-decay-iters ({args.lr_decay_iters})): "
            f"lower it or raise --lr-decay-iters"
        )
    _check_wsd(args, "--lr-wsd-decay-iters", args.lr_wsd_decay_iters, "--lr-decay-iters", args.lr_decay_iters)
    gbs = args.global_batch_size
    wsd = None if args.lr_wsd_decay_iters is None else args.lr_wsd_decay_iters * gbs
    args.lr_schedule_samples = LearningRateScheduleSamples(
        warmup=args.lr_warmup_iters * gbs, decay=args.lr_decay_iters * gbs, wsd_decay=wsd,
        weight_decay_increment=args.train_iters * gbs)


def _validate_sample_schedule(args):
    if args.lr_decay_samples is None:
        args.lr_decay_samples = args.train_samples
    if args.lr_decay_samples <= 0:
        raise ValueError(f"--lr-decay-samples must be positive, got {args.lr_decay_samples}")
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_samples != 0:
            raise ValueError("--lr-warmup-fraction and --lr-warmup-samples are exclusive: pick one")
        _check_warmup_fraction(args)
        # Not rounded, as upstream: the scheduler warms up over fraction x decay samples exactly.
        args.lr_warmup_samples = args.lr_warmup_fraction * args.lr_decay_samples
    if args.lr_warmup_samples < 0 or args.lr_warmup_samples >= args.lr_decay_samples:
        raise ValueError(
            f"--lr-warmup-samples ({args.lr_warmup_samples}) must be in [0, --lr-decay-samples "
            f"({args.lr_decay_samples})): lower it or raise --lr-decay-samples"
        )
    _check_wsd(args, "--lr-wsd-decay-samples", args.lr_wsd_decay_samples, "--lr-decay-samples",
               args.lr_decay_samples)
    args.lr_schedule_samples = LearningRateScheduleSamples(
        warmup=args.lr_warmup_samples, decay=args.lr_decay_samples, wsd_decay=args.lr_wsd_decay_samples,
        weight_decay_increment=args.train_samples)


def _check_warmup_fraction(args):
    if not 0.0 <= args.lr_warmup_fraction < 1.0:
        raise ValueError(f"--lr-warmup-fraction must be in [0, 1), got {args.lr_warmup_fraction}")


def _check_wsd(args, wsd_flag, wsd_value, decay_flag, decay_value):
    if args.lr_decay_style != "WSD":
        if wsd_value is not None or args.lr_wsd_decay_style is not None:
            flag = wsd_flag if wsd_value is not None else "--lr-wsd-decay-style"
            raise ValueError(f"{flag} needs --lr-decay-style WSD")
        args.lr_wsd_decay_style = "exponential"  # upstream's default; unused outside WSD
        return
    if args.lr_wsd_decay_style is None:
        args.lr_wsd_decay_style = "exponential"
    if wsd_value is None:
        raise ValueError(f"--lr-decay-style WSD needs {wsd_flag}")
    if not 0 < wsd_value <= decay_value:
        raise ValueError(f"{wsd_flag} ({wsd_value}) must be in (0, {decay_flag} ({decay_value})]")


@dataclasses.dataclass(frozen=True)
class LearningRateScheduleSamples:
    """The scheduler's lengths in samples (it counts samples, so batch sizes stay exact): warm-up, decay end,
    WSD anneal (None unless --lr-decay-style WSD) and the weight-decay increase."""

    warmup: float
    decay: int
    wsd_decay: int | None
    weight_decay_increment: int

"""Logging and evaluation flags: the log line, TensorBoard and Weights & Biases scalars, the metrics file and
the progress log of --save (see megatron/training/training_log.py, scalar_writers.py, progress_log.py)."""

import importlib.util
import sys
import warnings


def add_arguments(parser):
    group = parser.add_argument_group("logging and evaluation")
    group.add_argument("--log-interval", type=int, default=100, help="Iterations between log lines.")
    group.add_argument("--eval-interval", type=int, default=1000, help="Iterations between validation runs.")
    group.add_argument("--eval-iters", type=int, default=100,
                       help="Global batches per validation run (0 disables evaluation); with --full-validation each "
                       "run covers the whole validation set instead.")
    group.add_argument("--tensorboard-dir", default=None, help="Write TensorBoard scalars here.")
    group.add_argument("--tensorboard-log-interval", type=int, default=1, help="Iterations between scalars.")
    group.add_argument("--tensorboard-queue-size", type=int, default=1000,
                       help="Scalars TensorBoard's writer queues before it writes them to disk.")
    group.add_argument("--log-num-zeros-in-grad", action="store_true", help="Count zero gradient elements.")
    group.add_argument("--log-throughput", action="store_true",
                       help="Add the TFLOP/s per GPU (upstream's FLOPs estimate) to the log line, and a line of "
                       "tokens/s.")
    group.add_argument("--log-memory-to-tensorboard", action="store_true", help="Memory scalars and log line.")
    group.add_argument(
        "--log-params-norm",
        action="store_true",
        help="Log the global L2 norm of the parameters (the optimizer's main copies) every iteration.",
    )
    group.add_argument(
        "--log-timers-to-tensorboard",
        action="store_true",
        help="Write each timer of --timing-log-level (the maximum over ranks, per iteration) to TensorBoard as "
        "<name>-time, and the mean time per iteration of each log line as iteration-time.",
    )
    group.add_argument(
        "--log-validation-ppl-to-tensorboard",
        action="store_true",
        help="Also write the validation perplexity (<loss> validation ppl, and vs samples) to TensorBoard.",
    )
    group.add_argument(
        "--timing-log-level",
        type=int,
        default=0,
        choices=[0, 1, 2],
        help="Timers to measure and log at each --log-interval: 0 the per-iteration time and the one-off timers "
        "(set-up, checkpoint save/load); 1 also forward-backward, all-grads-sync, params-all-gather, "
        "embedding-grads-all-reduce, optimizer; 2 also batch-generator, forward-compute, backward-compute.",
    )
    group.add_argument(
        "--timing-log-option",
        default="minmax",
        choices=["max", "minmax", "all"],
        help="How the timers of all ranks are reported: the maximum, the minimum and maximum, or every rank.",
    )
    group.add_argument(
        "--no-barrier-with-level-1-timing",
        dest="barrier_with_L1_time",
        action="store_false",
        help="Do not pass a barrier before starting and stopping level-1 timers (by default they measure the "
        "slowest rank).",
    )
    group.add_argument(
        "--log-energy",
        action="store_true",
        help="Log the energy (J per iteration) and power (W) per GPU, read through NVML (pynvml); on other devices "
        "or without pynvml a message says so and nothing is logged.",
    )
    group.add_argument("--log-batch-size-to-tensorboard", action="store_true",
                       help="Write the global batch size (batch-size) with the scalars.")
    group.add_argument("--log-learning-rate-to-tensorboard", dest="log_learning_rate_to_tensorboard",
                       action="store_true", default=True, help="Write the learning rate (on by default).")
    # Upstream spells it --no-log-learnig-rate-to-tensorboard: its launch scripts pass that spelling.
    group.add_argument("--no-log-learning-rate-to-tensorboard", "--no-log-learnig-rate-to-tensorboard",
                       dest="log_learning_rate_to_tensorboard", action="store_false",
                       help="Do not write the learning rate.")
    group.add_argument("--log-loss-scale-to-tensorboard", dest="log_loss_scale_to_tensorboard",
                       action="store_true", default=True, help="Write the loss scale (on by default).")
    group.add_argument("--no-log-loss-scale-to-tensorboard", dest="log_loss_scale_to_tensorboard",
                       action="store_false", help="Do not write the loss scale.")
    group.add_argument("--log-world-size-to-tensorboard", action="store_true",
                       help="Write the number of ranks (world-size) with the scalars.")
    group.add_argument("--wandb-project", default="",
                       help="Also send the scalars written to TensorBoard to this Weights & Biases project (from the "
                       "last rank; needs `pip install wandb` and --wandb-exp-name).")
    group.add_argument("--wandb-exp-name", default="", help="Name of the W&B run (with --wandb-project).")
    group.add_argument("--wandb-save-dir", default="",
                       help="Local directory of the W&B run (default <--save>/wandb).")
    group.add_argument("--wandb-entity", default="", help="W&B entity (team or user) of --wandb-project.")
    group.add_argument("--log-progress", action="store_true",
                       help="Append job start, checkpoint and end lines (iteration, consumed tokens, floating-point "
                       "operations so far, throughput) to <--save>/progress.txt.")
    group.add_argument(
        "--metrics-file",
        default=None,
        help="JSON-lines metrics, one line per iteration; default <tensorboard-dir or save>/metrics.jsonl.",
    )


def validate(args):
    for flag, value in (
        ("--log-interval", args.log_interval),
        ("--eval-interval", args.eval_interval),
        ("--tensorboard-log-interval", args.tensorboard_log_interval),
        ("--tensorboard-queue-size", args.tensorboard_queue_size),
    ):
        if value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    if args.eval_iters < 0:
        raise ValueError(f"--eval-iters must be >= 0, got {args.eval_iters}")
    if args.log_progress and not args.save:
        raise ValueError("--log-progress writes progress.txt in the checkpoint directory: add --save (or drop "
                         "--log-progress)")
    _validate_wandb(args)
    _warn_scalar_flags_without_a_writer(args)


# Flags whose only effect is on the scalars TensorBoard and W&B receive: (flag, attribute, value that asks nothing).
_SCALAR_ONLY_FLAGS = (
    ("--log-timers-to-tensorboard", "log_timers_to_tensorboard", False),
    ("--log-validation-ppl-to-tensorboard", "log_validation_ppl_to_tensorboard", False),
    ("--log-world-size-to-tensorboard", "log_world_size_to_tensorboard", False),
    ("--log-batch-size-to-tensorboard", "log_batch_size_to_tensorboard", False),
    ("--tensorboard-log-interval", "tensorboard_log_interval", 1),
)


def _warn_scalar_flags_without_a_writer(args):
    """Upstream ignores these without a writer; here the run says which of them write nothing, and why."""
    if args.tensorboard_dir:
        return
    if not args.wandb_project:
        given = [flag for flag, name, inactive in _SCALAR_ONLY_FLAGS if getattr(args, name) != inactive]
        if given:
            warnings.warn(f"{', '.join(given)} without --tensorboard-dir or --wandb-project: these scalars are "
                          "written nowhere; add --tensorboard-dir DIR (or --wandb-project) to get them")
        if args.log_memory_to_tensorboard:
            warnings.warn("--log-memory-to-tensorboard without --tensorboard-dir or --wandb-project: the memory "
                          "line is printed at every log line, but no mem-* scalars are written; add "
                          "--tensorboard-dir DIR (or --wandb-project) to get them")
    if args.tensorboard_queue_size != 1000:
        warnings.warn(f"--tensorboard-queue-size {args.tensorboard_queue_size} without --tensorboard-dir: there is "
                      "no TensorBoard writer to queue for; add --tensorboard-dir DIR")


def _validate_wandb(args):
    if not args.wandb_project:
        given = [flag for flag, value in (("--wandb-exp-name", args.wandb_exp_name),
                                          ("--wandb-save-dir", args.wandb_save_dir),
                                          ("--wandb-entity", args.wandb_entity)) if value]
        if given:
            warnings.warn(f"{' '.join(given)} without --wandb-project: nothing is sent to Weights & Biases; add "
                          "--wandb-project to log there")
        return
    if not args.wandb_exp_name:
        raise ValueError("--wandb-project needs --wandb-exp-name (the name of the W&B run)")
    if not (args.wandb_save_dir or args.save):
        raise ValueError("--wandb-project keeps its local files in --wandb-save-dir (default <--save>/wandb): give "
                         "one of them")
    if "wandb" not in sys.modules and importlib.util.find_spec("wandb") is None:
        raise ValueError("--wandb-project needs the wandb package, which is not installed: `pip install wandb`, or "
                         "drop --wandb-project")

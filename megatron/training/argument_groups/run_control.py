"""Run-control flags: wall-clock limit, allocator cache release, logging level, weight-hash checks across
data-parallel replicas, periodic device synchronisation, evaluation without training, skipped iterations (see
megatron/training/run_control.py); upstream's --test-mode stops at validation."""


def add_arguments(parser):
    group = parser.add_argument_group("run control")
    group.add_argument("--exit-duration-in-mins", type=int, default=None,
                       help="Stop after this many minutes of training (checked after every training and evaluation "
                       "step on all ranks together); saves a checkpoint first when --save is set. 0: no limit, as "
                       "upstream.")
    group.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                       help="Release the allocator's unused cached memory: 0 never, 1 after forward-backward and "
                       "each evaluation step, 2 also after the optimizer step (GPU; CPU keeps no cache).")
    group.add_argument("--logging-level", type=int, default=None,
                       help="Level of the root logger (e.g. 10 DEBUG, 20 INFO); wins over MEGATRON_LOGGING_LEVEL.")
    group.add_argument("--check-weight-hash-across-dp-replicas-interval", type=int, default=None,
                       help="Every N iterations (and before the first) compare a SHA-1 of every parameter across the "
                       "data-parallel replicas and stop with an error naming any that differ.")
    group.add_argument("--skip-train", action="store_true",
                       help="Do not train: evaluate the (loaded) model once on the validation and test sets and stop.")
    group.add_argument("--iterations-to-skip", type=int, nargs="+", default=[],
                       help="Steps whose global batch is read and dropped: no forward, backward or optimizer step, no "
                       "log line; consumed samples still advance. Counted as upstream counts them, in completed "
                       "iterations: 3 drops the 4th global batch (the step the log would number 4).")
    group.add_argument("--train-sync-interval", type=int, default=None,
                       help="Synchronise the device every N iterations, as upstream, so the host cannot run more than "
                       "N iterations ahead of the GPU (each step here already ends with one, to time it; a no-op on "
                       "CPU). Default: never.")
    group.add_argument("--test-mode", action="store_true",
                       help="Upstream: run its real-time tests alongside training. This build's checks are the "
                       "pytest suites under tests/: an error.")


def validate(args):
    if args.test_mode:
        raise ValueError("--test-mode is not supported: training here runs no tests alongside it. Drop the flag; "
                         "run the unit tests (pytest tests/unit_tests) or the golden-value functional tests "
                         "(tests/functional_tests) instead")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins < 0:
        raise ValueError(f"--exit-duration-in-mins must be positive (0 turns the limit off), got "
                         f"{args.exit_duration_in_mins}")
    if args.exit_duration_in_mins == 0:
        args.exit_duration_in_mins = None  # upstream's 0: no wall-clock limit
    if args.logging_level is not None and args.logging_level < 0:
        raise ValueError(f"--logging-level must be a non-negative logging level, got {args.logging_level}")
    interval = args.check_weight_hash_across_dp_replicas_interval
    if interval is not None and interval <= 0:
        raise ValueError(f"--check-weight-hash-across-dp-replicas-interval must be positive, got {interval}")
    if args.train_sync_interval is not None and args.train_sync_interval <= 0:
        raise ValueError(f"--train-sync-interval must be a positive number of iterations, got "
                         f"{args.train_sync_interval} (drop the flag to never synchronise)")
    bad = [iteration for iteration in args.iterations_to_skip if iteration < 0]
    if bad:
        raise ValueError(f"--iterations-to-skip takes completed-iteration counts >= 0, got {bad}")
    if args.skip_train and args.eval_iters == 0:
        raise ValueError("--skip-train only evaluates, and --eval-iters 0 turns evaluation off: the run would do "
                         "nothing. Give --eval-iters N (batches per evaluation) or drop --skip-train")
    if args.skip_train and args.iterations_to_skip:
        raise ValueError("--iterations-to-skip drops training steps, but --skip-train runs none: drop one of them")

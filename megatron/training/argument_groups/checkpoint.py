"""Checkpoint flags."""


def add_arguments(parser):
    group = parser.add_argument_group("checkpointing")
    group.add_argument("--save", default=None, help="Directory to save checkpoints to.")
    group.add_argument("--load", default=None, help="Directory to load the latest checkpoint from.")
    group.add_argument("--save-interval", type=int, default=None, help="Iterations between checkpoints.")
    group.add_argument(
        "--ckpt-format",
        default="torch_dist",
        choices=["torch", "torch_dist", "torch_dcp"],
        help="torch: one file per model-parallel rank; torch_dist/torch_dcp: torch.distributed.checkpoint.",
    )
    group.add_argument("--no-save-optim", action="store_true", help="Leave optimizer state out of checkpoints.")
    group.add_argument("--no-save-rng", action="store_true", help="Leave RNG state out of checkpoints.")
    group.add_argument("--no-load-optim", action="store_true", help="Do not restore optimizer and scheduler.")
    group.add_argument("--no-load-rng", action="store_true", help="Do not restore RNG state.")
    group.add_argument(
        "--finetune",
        action="store_true",
        help="Load model weights only and start from iteration 0 (no optimizer, scheduler or RNG state).",
    )
    group.add_argument("--exit-on-missing-checkpoint", action="store_true", help="Fail if --load has none.")
    group.add_argument("--async-save", action="store_true", help="Write checkpoints in the background.")


def validate(args):
    if args.save_interval is not None and args.save_interval <= 0:
        raise ValueError(f"--save-interval must be positive, got {args.save_interval}")
    if args.save_interval is not None and args.save is None:
        raise ValueError("--save-interval needs --save DIR")
    if args.async_save and args.ckpt_format != "torch_dist":
        raise ValueError("--async-save needs --ckpt-format torch_dist")

"""Checkpoint flags."""

from megatron.core.dist_checkpointing.strictness import STRICTNESS_CHOICES

LOGICAL_FORMATS = ("torch_dist", "torch_dcp", "fsdp_dtensor")


def add_arguments(parser):
    group = parser.add_argument_group("checkpointing")
    group.add_argument("--save", default=None, help="Directory to save checkpoints to.")
    group.add_argument("--load", default=None, help="Directory to load the latest checkpoint from.")
    group.add_argument("--save-interval", type=int, default=None, help="Iterations between checkpoints.")
    group.add_argument(
        "--ckpt-format",
        default="torch_dist",
        choices=["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"],
        help="torch_dist (default), torch_dcp, fsdp_dtensor: three names of one logical format written with "
        "torch.distributed.checkpoint, which loads at any TP/PP/DP and under any wrapper (torch_dcp and "
        "fsdp_dtensor are upstream's names under FSDP2 and Megatron-FSDP). torch: Megatron's legacy files, one per "
        "model-parallel rank, loadable only at the same TP/PP. Formats each wrapper takes: DDP, with or without "
        "--use-distributed-optimizer: torch, torch_dist, torch_dcp, fsdp_dtensor; --use-megatron-fsdp: torch_dist, "
        "torch_dcp, fsdp_dtensor (torch is rejected when --save or --load is given); --use-torch-fsdp2: torch_dist, "
        "torch_dcp (anything else is rejected, with or without --save/--load). --async-save and --keep-last-n "
        "need torch_dist, torch_dcp or fsdp_dtensor.",
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
    group.add_argument(
        "--async-save",
        action="store_true",
        help="Write torch_dist checkpoints in the background while training continues; a checkpoint is "
        "published (tracker updated) only after every rank's write succeeded.",
    )
    group.add_argument(
        "--use-persistent-ckpt-worker",
        action="store_true",
        help="With --async-save: keep one background writer for the whole run instead of one per save.",
    )
    group.add_argument(
        "--dist-ckpt-strictness",
        default="assume_ok_unexpected",
        choices=STRICTNESS_CHOICES,
        help="torch_dist loads: handling of checkpoint tensors the model lacks (unexpected) and model tensors "
        "the checkpoint lacks (missing): assume_ok_unexpected (default; missing fail), log_unexpected, log_all "
        "(missing keep their initial values), raise_unexpected, raise_all, return_unexpected, return_all, "
        "ignore_all. A tensor of another shape always fails.",
    )
    group.add_argument(
        "--keep-last-n",
        type=int,
        default=None,
        help="torch_dist: keep only the N most recent published checkpoints under --save (default: keep all).",
    )
    group.add_argument(
        "--ckpt-fully-parallel-save",
        action="store_true",
        default=True,
        help="torch_dist: spread the writing of replicated tensors over data-parallel ranks (the default).",
    )
    group.add_argument(
        "--no-ckpt-fully-parallel-save",
        action="store_false",
        dest="ckpt_fully_parallel_save",
        help="torch_dist: the first data-parallel rank writes every replicated tensor.",
    )
    group.add_argument(
        "--ckpt-fully-parallel-load",
        action="store_true",
        help="torch_dist: spread the reading of replicated tensors over data-parallel ranks.",
    )
    group.add_argument(
        "--ckpt-assume-constant-structure",
        action="store_true",
        help="torch_dist: reuse the save plan of the previous checkpoint (the model's state keeps its layout).",
    )


def validate(args):
    if args.save_interval is not None and args.save_interval <= 0:
        raise ValueError(f"--save-interval must be positive, got {args.save_interval}")
    if args.save_interval is not None and args.save is None:
        raise ValueError("--save-interval needs --save DIR")
    if args.async_save and args.ckpt_format not in LOGICAL_FORMATS:
        raise ValueError(f"--async-save needs --ckpt-format torch_dist (or {', '.join(LOGICAL_FORMATS[1:])}), "
                         f"got --ckpt-format {args.ckpt_format}")
    if args.use_persistent_ckpt_worker and not args.async_save:
        raise ValueError("--use-persistent-ckpt-worker needs --async-save")
    if args.keep_last_n is not None and args.keep_last_n <= 0:
        raise ValueError(f"--keep-last-n must be positive, got {args.keep_last_n}")
    if args.keep_last_n is not None and args.ckpt_format not in LOGICAL_FORMATS:
        raise ValueError("--keep-last-n needs --ckpt-format torch_dist")
    uses_fsdp = getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_torch_fsdp2", False)
    if uses_fsdp and args.ckpt_format == "torch" and (args.save or args.load):
        flag = "--use-torch-fsdp2" if getattr(args, "use_torch_fsdp2", False) else "--use-megatron-fsdp"
        raise ValueError(f"{flag} checkpoints need --ckpt-format torch_dist (or fsdp_dtensor / torch_dcp); the "
                         "torch format stores whole, unsharded tensors per model-parallel rank")
    expert_parallel_size = getattr(args, "expert_model_parallel_size", 1) or 1
    if expert_parallel_size > 1 and args.ckpt_format == "torch" and (args.save or args.load):
        raise ValueError(f"--expert-model-parallel-size {expert_parallel_size} checkpoints need --ckpt-format "
                         "torch_dist (experts saved by global index); the torch format keeps one file per "
                         "tensor/pipeline rank, which holds only one expert-parallel rank's experts")

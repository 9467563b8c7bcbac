"""Checkpoint flags."""

import os

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
        "--ckpt-step", type=int, default=None,
        help="Load the checkpoint of this iteration under --load instead of the latest one the tracker names.",
    )
    group.add_argument(
        "--pretrained-checkpoint", default=None,
        help="Where --load holds no checkpoint (or is not given): load the latest checkpoint here as --finetune "
        "does (weights only, iteration 0); once the run has saved under --load, relaunches resume from there.",
    )
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
        help="torch_dist loads, as upstream: handling of model tensors the checkpoint lacks (unexpected) and "
        "checkpoint tensors the model does not ask for (missing): assume_ok_unexpected (default) and "
        "raise_unexpected: unexpected fail, missing ignored; log_unexpected: unexpected listed and left as "
        "initialised; log_all: both listed; raise_all: either fails; return_unexpected, return_all, ignore_all: "
        "unexpected left as initialised. A tensor of another shape always fails.",
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
        "--auto-detect-ckpt-format",
        action="store_true",
        help="Load the --load checkpoint in whichever format it is (torch or torch_dist), whatever --ckpt-format "
        "says; saving still uses --ckpt-format.",
    )
    group.add_argument("--use-dist-ckpt", action="store_true", dest="use_dist_ckpt_deprecated",
                       help="Deprecated: the same as --ckpt-format torch_dist (the default).")
    group.add_argument("--dist-ckpt-format", default=None, choices=["torch_dist", "zarr"],
                       dest="dist_ckpt_format_deprecated",
                       help="Deprecated: use --ckpt-format. torch_dist maps to it; zarr is not supported.")
    group.add_argument(
        "--ckpt-convert-format",
        default=None,
        choices=["torch", "torch_dist", "zarr"],
        help="Load the --load checkpoint, save it in this format to <--ckpt-convert-save>/<format>, and stop (no "
        "training). zarr is not supported.",
    )
    group.add_argument("--ckpt-convert-save", default=None,
                       help="Where --ckpt-convert-format F writes: into its subdirectory F (DIR/torch or "
                       "DIR/torch_dist).")
    group.add_argument(
        "--save-retain-interval",
        type=int,
        default=None,
        help="After each successful save, delete the checkpoints under --save whose iteration is not a multiple "
        "of N, except the latest.",
    )
    group.add_argument(
        "--non-persistent-save-interval",
        type=int,
        default=None,
        help="Also save a non-persistent checkpoint every N iterations (only the latest is kept); a load resumes "
        "the newer of it and the persistent one.",
    )
    group.add_argument(
        "--non-persistent-ckpt-type",
        default="global",
        choices=["global", "local", "in_memory"],
        help="global (default): torch_dist checkpoints in --non-persistent-global-ckpt-dir. local: each rank writes "
        "its own part of the training state (model, optimizer, scheduler, RNG, iteration) to "
        "--non-persistent-local-ckpt-dir, e.g. node-local storage; loadable only under the same parallel layout and "
        "world size, and resumed (with or without --load) when newer than the global checkpoint and complete on "
        "every rank. in_memory (nvidia-resiliency-ext in upstream Megatron-LM) is not supported.",
    )
    group.add_argument("--non-persistent-global-ckpt-dir", default=None,
                       help="Non-persistent checkpoints' directory (default: <--save>/non_persistent when saving, "
                       "<--load>/non_persistent when loading).")
    group.add_argument("--non-persistent-local-ckpt-dir", default=None,
                       help="--non-persistent-ckpt-type local: the directory each rank writes its part to "
                       "(DIR/rank_NNNNN/iter_NNNNNNN, via a .tmp directory renamed once fsynced); may be node-local.")
    group.add_argument("--non-persistent-local-ckpt-algo", default=None, choices=["fully_parallel", "atomic"],
                       help="--non-persistent-ckpt-type local: fully_parallel (default): a tensor piece that several "
                       "ranks hold (data- or tensor-parallel replicas) is written once, by one of them (balanced by "
                       "bytes), and sent back to the others by broadcasts at load; atomic: every rank writes all it "
                       "holds, so its part restores it without communication. Both write each part to a temporary "
                       "directory and rename it (upstream's nvidia-resiliency-ext replication is not implemented).")
    group.add_argument(
        "--ckpt-assume-constant-structure",
        action="store_true",
        help="torch_dist: reuse the save plan of the previous checkpoint (the model's state keeps its layout).",
    )


def _print_rank0(args, message):
    if getattr(args, "rank", 0) == 0:
        print(message, flush=True)


def _validate_deprecated_aliases(args):
    """--use-dist-ckpt and --dist-ckpt-format torch_dist name the default format under their old names."""
    if args.dist_ckpt_format_deprecated == "zarr":
        raise ValueError("--dist-ckpt-format zarr: the zarr format is not supported (upstream deprecated it too); "
                         "use --ckpt-format torch_dist")
    for given, flag in ((args.use_dist_ckpt_deprecated, "--use-dist-ckpt"),
                        (args.dist_ckpt_format_deprecated, "--dist-ckpt-format torch_dist")):
        if not given:
            continue
        if args.ckpt_format not in LOGICAL_FORMATS:
            raise ValueError(f"{flag} asks for the torch_dist format but --ckpt-format is {args.ckpt_format}: drop "
                             f"{flag.split()[0]} (deprecated) and keep one --ckpt-format")
        _print_rank0(args, f"WARNING: {flag} is deprecated; use --ckpt-format torch_dist (the default)")


def _validate_conversion(args):
    if args.ckpt_convert_save is not None and args.ckpt_convert_format is None:
        raise ValueError("--ckpt-convert-save needs --ckpt-convert-format torch|torch_dist")
    if args.ckpt_convert_format is None:
        return
    if args.ckpt_convert_format == "zarr":
        raise ValueError("--ckpt-convert-format zarr: the zarr format is not supported; convert to torch_dist")
    if args.load is None or args.ckpt_convert_save is None:
        raise ValueError(f"--ckpt-convert-format {args.ckpt_convert_format} needs --load DIR (the checkpoint to "
                         "convert) and --ckpt-convert-save DIR (where the converted one goes)")
    target = os.path.join(args.ckpt_convert_save, args.ckpt_convert_format)
    if os.path.abspath(target) == os.path.abspath(args.load):
        raise ValueError(f"--ckpt-convert-format {args.ckpt_convert_format} --ckpt-convert-save "
                         f"{args.ckpt_convert_save} writes into {target}, which is --load: give another "
                         "--ckpt-convert-save")


def _validate_retention(args):
    interval = args.save_retain_interval
    if interval is None:
        return
    if interval <= 0:
        raise ValueError(f"--save-retain-interval must be positive, got {interval}")
    if args.save is None:
        raise ValueError("--save-retain-interval needs --save DIR")
    if args.keep_last_n is not None:
        raise ValueError("--save-retain-interval and --keep-last-n both delete checkpoints: pick one")
    if args.save_interval is not None and interval % args.save_interval != 0:
        raise ValueError(f"--save-retain-interval {interval} must be a multiple of --save-interval "
                         f"{args.save_interval}, else no periodic checkpoint would be retained")


def _validate_non_persistent(args):
    kind = args.non_persistent_ckpt_type
    if kind == "in_memory":
        raise ValueError("--non-persistent-ckpt-type in_memory: in-memory non-persistent checkpoints "
                         "(nvidia-resiliency-ext in upstream Megatron-LM) are not supported; use "
                         "--non-persistent-ckpt-type local (per-rank files in --non-persistent-local-ckpt-dir) or "
                         "global (torch_dist checkpoints in --non-persistent-global-ckpt-dir)")
    if kind != "local":
        for value, flag in ((args.non_persistent_local_ckpt_dir, "--non-persistent-local-ckpt-dir"),
                            (args.non_persistent_local_ckpt_algo, "--non-persistent-local-ckpt-algo")):
            if value is not None:
                raise ValueError(f"{flag} needs --non-persistent-ckpt-type local (the type is {kind})")
    else:
        if args.non_persistent_local_ckpt_dir is None:
            raise ValueError("--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir DIR (where each "
                             "rank writes its part)")
        if args.non_persistent_local_ckpt_algo is None:
            args.non_persistent_local_ckpt_algo = "fully_parallel"
    interval = args.non_persistent_save_interval
    if interval is None:
        return
    if interval <= 0:
        raise ValueError(f"--non-persistent-save-interval must be positive, got {interval}")
    if kind == "local":
        return
    if args.save is None and args.non_persistent_global_ckpt_dir is None:
        raise ValueError("--non-persistent-save-interval needs --save DIR (they go to DIR/non_persistent) or "
                         "--non-persistent-global-ckpt-dir DIR")
    if args.ckpt_format not in LOGICAL_FORMATS:
        raise ValueError("--non-persistent-save-interval writes torch_dist checkpoints: it needs --ckpt-format "
                         f"torch_dist, got --ckpt-format {args.ckpt_format}")
    directory = args.non_persistent_global_ckpt_dir
    for flag, path in (("--save", args.save), ("--load", args.load)):
        if directory is not None and path is not None and os.path.realpath(directory) == os.path.realpath(path):
            raise ValueError(f"--non-persistent-global-ckpt-dir {directory} is {flag}: only the latest "
                             "non-persistent checkpoint is kept there, so each non-persistent save would delete the "
                             f"persistent checkpoints of {flag}; give it a directory of its own (by default "
                             "<--save>/non_persistent)")


def _validate_directories(args):
    for flag, path, what in (("--save", args.save, "the directory checkpoints are written into"),
                             ("--load", args.load, "the checkpoint root directory, which holds "
                              "latest_checkpointed_iteration.txt and the iter_* directories")):
        if path is not None and os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"{flag} {path} is a file, not a directory: {flag} takes {what}")
    blocking_file = _file_among_parents(args.save)
    if blocking_file is not None:
        raise ValueError(f"--save {args.save} cannot be created: {blocking_file} is a file, not a directory; point "
                         "--save at a directory path (it is created if missing)")


def _file_among_parents(path):
    """The nearest existing ancestor of a missing `path` when it is a file (the checkpoint directory could never
    be created under it, which would otherwise surface only after the model is built), else None."""
    if path is None or os.path.exists(path):
        return None
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    return parent if os.path.exists(parent) and not os.path.isdir(parent) else None


def validate(args):
    _validate_deprecated_aliases(args)
    _validate_directories(args)
    _validate_conversion(args)
    _validate_retention(args)
    _validate_non_persistent(args)
    if args.ckpt_step is not None and (args.load is None or args.ckpt_step < 0):
        raise ValueError(f"--ckpt-step {args.ckpt_step} names an iteration under --load: it needs --load DIR and an "
                         "iteration >= 0")
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
    if args.ckpt_convert_format == "torch" and (uses_fsdp or expert_parallel_size > 1):
        raise ValueError("--ckpt-convert-format torch: the torch format holds DDP checkpoints without expert "
                         "parallelism only (one file per tensor/pipeline rank); convert with "
                         "--ckpt-convert-format torch_dist")

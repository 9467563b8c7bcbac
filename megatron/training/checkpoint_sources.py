"""Which checkpoint `--load` resumes, and in which format.

Two roots may hold checkpoints of a run: `--load DIR` (the persistent ones, written by `--save-interval`) and
the non-persistent root (`--non-persistent-global-ckpt-dir`, by default `DIR/non_persistent`, written by
`--non-persistent-save-interval`). Each has its own tracker file; the newer of the two checkpoints is resumed
(the persistent one on a tie; a released checkpoint, whose tracker says "release", is older than any
other). The format of a checkpoint is read from its directory, so that
`--auto-detect-ckpt-format` (and `--use-checkpoint-args`) work whatever `--ckpt-format` says.

Plain file operations only: `--use-checkpoint-args` uses this module before any process group exists.
"""

import glob
import os
import pickle
from typing import NamedTuple, Optional

from megatron.core.dist_checkpointing.checkpoint_directory import (
    RELEASE,
    REPLACED_SUFFIX,
    TRACKER_FILENAME,
    earlier_checkpoint_advice,
    iteration_dir_name,
    published_iterations,
    read_tracker,
)
from megatron.core.dist_checkpointing.errors import CheckpointError

NON_PERSISTENT_SUBDIR = "non_persistent"
DCP_INDEX_FILENAME = ".metadata"
TORCH_FORMAT_FILENAME = "model_optim_rng.pt"


class CheckpointSource(NamedTuple):
    root: str  # the directory holding the tracker
    iteration: int  # or RELEASE: the released checkpoint in `root/release`
    format: Optional[str]  # "torch", "torch_dist", or None when the iteration's directory is missing
    non_persistent: bool

    @property
    def directory(self):
        """The iteration's directory (its `.replaced` copy when a re-save was interrupted between renames)."""
        directory = os.path.join(self.root, iteration_dir_name(self.iteration))
        if not os.path.isdir(directory) and os.path.isdir(directory + REPLACED_SUFFIX):
            return directory + REPLACED_SUFFIX
        return directory


def detect_format(directory) -> Optional[str]:
    """'torch_dist' for a torch.distributed.checkpoint directory, 'torch' for Megatron's per-rank files."""
    if not os.path.isdir(directory):
        return None
    names = os.listdir(directory)
    if DCP_INDEX_FILENAME in names:
        return "torch_dist"
    if any(name.startswith("mp_rank_") for name in names):
        return "torch"
    return None


def checkpoint_iterations(root):
    """Iterations of the published directories under `root` that hold a checkpoint of either format, ascending."""
    return [iteration for iteration in published_iterations(root)
            if detect_format(os.path.join(root, iteration_dir_name(iteration))) is not None]


def non_persistent_save_dir(args) -> Optional[str]:
    if getattr(args, "non_persistent_global_ckpt_dir", None):
        return args.non_persistent_global_ckpt_dir
    return os.path.join(args.save, NON_PERSISTENT_SUBDIR) if args.save else None


def non_persistent_load_dir(args) -> Optional[str]:
    if getattr(args, "non_persistent_global_ckpt_dir", None):
        return args.non_persistent_global_ckpt_dir
    return os.path.join(args.load, NON_PERSISTENT_SUBDIR) if args.load else None


def _tracked_iteration(root):
    return read_tracker(root) if root is not None and os.path.isdir(root) else None


def checkpoint_to_load(args) -> Optional[CheckpointSource]:
    """The checkpoint `--load` resumes: the newer of the persistent and the non-persistent one; None if neither.
    With `--ckpt-step N`: iteration N under `--load`, whatever the trackers say."""
    if getattr(args, "ckpt_step", None) is not None:
        return _chosen_step(args.load, args.ckpt_step)
    persistent = _tracked_iteration(args.load)
    non_persistent_root = non_persistent_load_dir(args)
    non_persistent = _tracked_iteration(non_persistent_root)
    if non_persistent is not None and (persistent is None or _order(non_persistent) > _order(persistent)):
        root, iteration, is_non_persistent = non_persistent_root, non_persistent, True
    elif persistent is not None:
        root, iteration, is_non_persistent = args.load, persistent, False
    else:
        return None
    source = CheckpointSource(root, iteration, None, is_non_persistent)
    if is_non_persistent and not os.path.isdir(source.directory):
        raise CheckpointError(_stale_non_persistent_tracker(source, args.load, persistent))
    return source._replace(format=detect_format(source.directory))


def _stale_non_persistent_tracker(source, load, persistent):
    """What to do when the non-persistent tracker names a checkpoint that is not there: `--ckpt-step` picks an
    iteration under --load (the persistent root), never one of the non-persistent root, which keeps only its
    latest checkpoint."""
    tracker = os.path.join(source.root, TRACKER_FILENAME)
    missing = os.path.join(source.root, iteration_dir_name(source.iteration))
    steps = checkpoint_iterations(load) if load is not None else []
    if persistent is not None:
        advice = (f"remove that tracker file to resume the persistent checkpoint under --load {load} (iteration "
                  f"{persistent})")
    else:
        advice = (f"remove that tracker file to start from scratch or from --pretrained-checkpoint (--load {load} has "
                  "no tracker of its own)")
    if steps:
        advice += f", or load an iteration of --load {load} with --ckpt-step N (N: {', '.join(map(str, steps))})"
    return (f"{tracker} (the non-persistent checkpoints, --non-persistent-global-ckpt-dir) names iteration "
            f"{source.iteration}, but {missing} does not exist (nor a {REPLACED_SUFFIX} copy of it); {advice}")


def _order(iteration):
    return -1 if iteration == RELEASE else iteration


def _chosen_step(root, iteration) -> CheckpointSource:
    source = CheckpointSource(root, iteration, None, False)
    format_name = detect_format(source.directory)
    if format_name is None:
        steps = checkpoint_iterations(root)
        raise FileNotFoundError(f"--ckpt-step {iteration}: {source.directory} is not a checkpoint; the iterations "
                                f"under --load {root} are {steps or 'none'}")
    return source._replace(format=format_name)


def pretrained_checkpoint(args) -> Optional[CheckpointSource]:
    """`--pretrained-checkpoint DIR`'s latest checkpoint, for a run whose --load has none (None without the flag).
    Raises when DIR holds none."""
    root = getattr(args, "pretrained_checkpoint", None)
    if root is None:
        return None
    iteration = _tracked_iteration(root)
    if iteration is None:
        raise FileNotFoundError(f"--pretrained-checkpoint {root}: no checkpoint there (no tracker file); and none "
                                f"under --load {args.load}")
    source = CheckpointSource(root, iteration, None, False)
    return source._replace(format=detect_format(source.directory))


def saved_args(source: CheckpointSource):
    """The arguments the checkpoint was trained with (None if it records none, e.g. converted from weights)."""
    if source.format == "torch":
        files = sorted(glob.glob(os.path.join(source.directory, "mp_rank_*", TORCH_FORMAT_FILENAME)))
        if not files:
            raise FileNotFoundError(f"{source.directory} holds no mp_rank_*/{TORCH_FORMAT_FILENAME}")
        import torch

        try:
            state = torch.load(files[0], map_location="cpu", weights_only=False)
        except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
            raise CheckpointError(f"checkpoint file {files[0]} is truncated or damaged ({type(exc).__name__}: "
                                  f"{exc}); {earlier_checkpoint_advice(source.directory)}") from exc
        return state.get("args")
    if source.format == "torch_dist":
        from megatron.core.dist_checkpointing import serialization

        metadata = serialization.read_metadata(source.directory)  # a damaged index: an error naming the file
        common = serialization.load({"common": None}, source.directory, single_process=True,
                                    metadata=metadata)["common"]
        return common.get("args")
    raise FileNotFoundError(f"{source.directory} is neither a torch nor a torch_dist checkpoint")

"""Shared by the checkpoint tools: make the repository importable and resolve a checkpoint directory."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def resolve_iteration_dir(path, flag="--input"):
    """A checkpoint root (with latest_checkpointed_iteration.txt) -> its latest iteration directory."""
    from megatron.training.checkpointing import iteration_dir_name, read_tracker

    if os.path.isfile(path):
        raise SystemExit(f"{flag} {path}: a file, not a checkpoint directory; give the checkpoint root (holding "
                         "latest_checkpointed_iteration.txt) or one of its iter_XXXXXXX directories")
    if not os.path.isdir(path):
        raise SystemExit(f"{flag} {path}: no such directory")
    iteration = read_tracker(path)
    if iteration is not None:
        return os.path.join(path, iteration_dir_name(iteration))
    return path


def is_release(path):
    """Whether `path` is a released checkpoint: a root whose tracker holds the word `release` (upstream's
    released checkpoints), or its `release` directory. A conversion keeps it released."""
    from megatron.core.dist_checkpointing.checkpoint_directory import RELEASE
    from megatron.training.checkpointing import read_tracker

    if os.path.basename(os.path.normpath(path)) == RELEASE:
        return True
    return os.path.isdir(path) and read_tracker(path) == RELEASE


def output_iteration(input_path, iteration):
    """The iteration a conversion of `input_path` publishes: `release` for a released checkpoint, else
    `iteration` (the one it records)."""
    from megatron.core.dist_checkpointing.checkpoint_directory import RELEASE

    return RELEASE if is_release(input_path) else iteration


def is_legacy_directory(directory):
    """Whether `directory` (an iteration directory) holds a --ckpt-format torch checkpoint's mp_rank_* files."""
    return any(name.startswith("mp_rank_") for name in os.listdir(directory))


def logical_checkpoint_dir(path, flag="--input"):
    """`resolve_iteration_dir(path)`, checked to be a torch_dist checkpoint; otherwise the exit message names
    `flag`, what the directory is instead and what to run."""
    directory = resolve_iteration_dir(path, flag)
    if os.path.isfile(os.path.join(directory, ".metadata")):
        return directory
    if os.path.isdir(directory) and is_legacy_directory(directory):
        raise SystemExit(f"{flag} {path}: a legacy --ckpt-format torch checkpoint (mp_rank_* directories), not the "
                         "logical torch_dist format; convert it first with: python "
                         f"tools/checkpoint/convert_legacy.py --input {path} --output NEW_ROOT")
    if os.path.isfile(os.path.join(directory, "config.json")):
        raise SystemExit(f"{flag} {path}: a Hugging Face model directory, not a torch_dist checkpoint; import it "
                         f"with: python tools/checkpoint/convert_checkpoint.py --from hf --input {path} --output "
                         "NEW_ROOT")
    raise SystemExit(f"{flag} {path}: not a torch_dist checkpoint ({directory} has no .metadata); give the root "
                     "that --save wrote (holding latest_checkpointed_iteration.txt) or one of its iter_XXXXXXX "
                     "directories")

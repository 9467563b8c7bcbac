"""Shared by the checkpoint tools: make the repository importable and resolve a checkpoint directory."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def resolve_iteration_dir(path):
    """A checkpoint root (with latest_checkpointed_iteration.txt) -> its latest iteration directory."""
    from megatron.training.checkpointing import iteration_dir_name, read_tracker

    if not os.path.isdir(path):
        raise SystemExit(f"{path}: no such directory")
    iteration = read_tracker(path)
    if iteration is not None:
        return os.path.join(path, iteration_dir_name(iteration))
    return path

"""`--save-retain-interval N`: after a successful save, keep only the checkpoints whose iteration is a multiple
of N, and the latest.

Runs on global rank 0 once the tracker names the checkpoint just saved, so the tracker never points at a
deleted directory. Only published `iter_XXXXXXX` directories are considered (a `.tmp` save in progress never
is); the `.replaced` copy of a deleted iteration goes with it. The non-persistent root is a subdirectory that
does not match that pattern, so it is never touched.
"""

import os
import shutil

from megatron.core.dist_checkpointing.checkpoint_directory import (
    REPLACED_SUFFIX,
    iteration_dir_name,
    published_iterations,
    read_tracker,
)


def iterations_to_remove(iterations, latest, retain_interval):
    """The iterations of `iterations` that are neither `latest` nor a multiple of `retain_interval`."""
    return [iteration for iteration in iterations if iteration != latest and iteration % retain_interval != 0]


def prune_to_retain_interval(root, latest, retain_interval):
    """Delete the checkpoints under `root` that --save-retain-interval does not keep; returns their iterations.
    Does nothing unless the tracker names `latest` (the save just published)."""
    if not retain_interval or read_tracker(root) != latest:
        return []
    removed = iterations_to_remove(published_iterations(root), latest, retain_interval)
    for iteration in removed:
        directory = os.path.join(root, iteration_dir_name(iteration))
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(directory + REPLACED_SUFFIX, ignore_errors=True)
    if removed:
        print(f"--save-retain-interval {retain_interval}: removed the checkpoints of iterations "
              f"{', '.join(map(str, removed))} under {root}", flush=True)
    return removed

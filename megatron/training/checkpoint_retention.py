"""What a checkpoint root keeps after a successful save.

`--save-retain-interval N`: only the checkpoints whose iteration is a multiple of N, and the latest. Only
published `iter_XXXXXXX` directories are considered (a `.tmp` save in progress never is); the `.replaced` copy of
a deleted iteration goes with it. The non-persistent root is a subdirectory that does not match that pattern, so
it is never touched.

Interrupted saves: a save killed part-way leaves `iter_XXXXXXX.tmp/` (or, killed right after publishing a
re-save, a stale `iter_XXXXXXX.replaced/` beside the complete directory). Once a later iteration is published,
those of earlier iterations are superseded: a run saves one checkpoint at a time and in order, and publishing
one of them now would move the tracker backwards. They are removed then; staging directories of later
iterations are kept (the save that reaches their iteration replaces them), and so is a `.replaced` copy whose
iteration directory is missing (it is what loading that iteration reads).

Both run on global rank 0 once the tracker names the checkpoint just saved, so the tracker never points at a
deleted directory.
"""

import os
import re
import shutil

from megatron.core.dist_checkpointing.checkpoint_directory import (
    REPLACED_SUFFIX,
    TEMPORARY_SUFFIX,
    iteration_dir_name,
    published_iterations,
    read_tracker,
)

_LEFTOVER_DIR = re.compile(rf"^iter_(\d{{7,}})({re.escape(TEMPORARY_SUFFIX)}|{re.escape(REPLACED_SUFFIX)})$")


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


def superseded_leftovers(names, latest):
    """The entries of `names` (a root's listing) that interrupted saves left and the checkpoint of `latest`
    supersedes: `iter_N.tmp` with N < latest, and `iter_N.replaced` with N < latest beside a complete `iter_N`."""
    present = set(names)
    leftovers = []
    for name in sorted(names):
        match = _LEFTOVER_DIR.match(name)
        if match is None or int(match.group(1)) >= latest:
            continue
        if match.group(2) == REPLACED_SUFFIX and name[:-len(REPLACED_SUFFIX)] not in present:
            continue  # the only copy of that iteration: loading it reads this one
        leftovers.append(name)
    return leftovers


def remove_superseded_leftovers(root, latest):
    """Delete what interrupted saves left under `root` that the checkpoint of `latest` supersedes (see the module
    docstring); returns their names. Does nothing unless the tracker names `latest` (the save just published)."""
    if not isinstance(latest, int) or read_tracker(root) != latest:
        return []
    removed = superseded_leftovers(os.listdir(root), latest)
    for name in removed:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    if removed:
        print(f"removed what interrupted saves left under {root} (superseded by the checkpoint of iteration "
              f"{latest}): {', '.join(removed)}", flush=True)
    return removed

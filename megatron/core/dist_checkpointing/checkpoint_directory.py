"""The on-disk layout of a checkpoint root, shared by every format: the tracker file, iteration directories,
and publishing a finished save so that an interrupted one never becomes the latest.

    latest_checkpointed_iteration.txt     the last published checkpoint's iteration, written last
    iter_0000010/                         one published checkpoint
    iter_0000020.tmp/                     a save in progress (or one that was interrupted): never loaded
    iter_0000010.replaced/                the previous copy while iteration 10 is saved again (see publish)
    release/                              a released checkpoint (upstream's tracker holds the word "release"):
                                          weights to start from, loaded as --finetune does; never written here

Plain file operations only (no torch.distributed): tools use it without a process group.
"""

import json
import os
import re
import shutil

from megatron.core.dist_checkpointing.errors import CheckpointError

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
METADATA_JSON = "metadata.json"
TEMPORARY_SUFFIX = ".tmp"
REPLACED_SUFFIX = ".replaced"  # the previous copy of an iteration saved again, while the new one moves in
RELEASE = "release"  # the tracker's word, and the directory's name, for a released checkpoint
_ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")  # 8 digits from iteration 10,000,000 on


class CheckpointSaveError(RuntimeError):
    """A checkpoint that could not be written: the message names the directory and what to do."""


def iteration_dir_name(iteration):
    if iteration == RELEASE:
        return RELEASE
    return f"iter_{iteration:07d}"


def write_tracker(root, iteration):
    """Point the tracker at `iteration`, atomically (temporary file + rename)."""
    path = os.path.join(root, TRACKER_FILENAME)
    temporary = f"{path}.tmp.{os.getpid()}"
    try:
        with open(temporary, "w") as stream:
            stream.write(str(iteration))
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except OSError:  # e.g. a full disk: the previous tracker stays, and no stray file beside it
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def read_tracker(root):
    """The iteration of the latest complete checkpoint under `root`, or None when there is none; `RELEASE` when
    the tracker names a released checkpoint (in `root/release`)."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as stream:
        raw = stream.read()
    text = raw.decode("utf-8", errors="replace").strip()
    if text == RELEASE:
        return RELEASE
    if re.fullmatch(r"[0-9]+", text) is None:  # also a damaged file (bytes that are no text) or a negative number
        shown = text if len(text) <= 40 else f"{text[:40]}..."
        published = published_iterations(root)
        there = f" (the iterations there: {', '.join(map(str, published))})" if published else ""
        raise ValueError(f"{path} should hold an iteration number (or {RELEASE!r}), found {shown!r}; write the "
                         f"iteration of a checkpoint under it there{there}")
    return int(text)


def unwritten_save_advice(root):
    """What a user does after a save under `--save root` failed to write, and which checkpoint is still the latest."""
    try:
        latest = read_tracker(root) if os.path.isdir(root) else None
    except ValueError as damaged:  # the save's own error comes first; the tracker's is said beside it
        still = f"its tracker is damaged too: {damaged}"
    else:
        still = (f"the latest checkpoint under {root} is still iteration {latest}" if latest is not None
                 else f"{root} holds no complete checkpoint yet")
    return f"make --save {root} writable with free space (or point --save elsewhere) and restart: {still}"


def earlier_checkpoint_advice(directory):
    """How to load the checkpoint before the damaged one in `directory` (ROOT/iter_XXXXXXX, or its .replaced copy):
    `--load ROOT --ckpt-step N` with the newest earlier published iteration, or that there is none."""
    root = os.path.dirname(os.path.normpath(directory))
    match = re.match(r"^iter_(\d{7,})", os.path.basename(os.path.normpath(directory)))
    earlier = [each for each in published_iterations(root) if match is None or each < int(match.group(1))]
    if not earlier:
        return f"there is no earlier checkpoint under {root}: train from scratch or --load another checkpoint"
    return (f"to resume the checkpoint before it, pass --load {root} --ckpt-step {earlier[-1]} (the earlier "
            f"iterations there: {', '.join(map(str, earlier))})")


def _fsync_directory(path):
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def published_iterations(root):
    """Iterations of the published checkpoints under `root`, ascending."""
    if not os.path.isdir(root):
        return []
    return sorted(int(match.group(1)) for match in map(_ITERATION_DIR.match, os.listdir(root)) if match)


def publish(root, iteration, temporary, layout, keep_last_n=None):
    """Rename `temporary` to `iter_XXXXXXX`, then point the tracker at it; prune to `keep_last_n` (rank 0).

    Saving an iteration that is already published (e.g. again after a resume) moves the old copy aside to
    `iter_XXXXXXX.replaced` first: a kill between the two renames leaves the tracker naming a missing
    directory, and `published_directory` then loads the `.replaced` copy. It is removed once the tracker
    names the new one.
    """
    with open(os.path.join(temporary, METADATA_JSON), "w") as stream:
        json.dump({"format": "megatron_logical_dcp", "version": 1, "iteration": iteration, "layout": layout},
                  stream, indent=1)
    move_into_place(root, iteration, temporary, keep_last_n)


def move_into_place(root, iteration, temporary, keep_last_n=None):
    """`publish` without the metadata.json summary (the torch format's directories have none)."""
    final = os.path.join(root, iteration_dir_name(iteration))
    replaced = final + REPLACED_SUFFIX
    if os.path.exists(final):
        shutil.rmtree(replaced, ignore_errors=True)  # a stale copy: `final` is complete
        os.replace(final, replaced)
    os.replace(temporary, final)
    _fsync_directory(root)
    write_tracker(root, iteration)
    shutil.rmtree(replaced, ignore_errors=True)
    if keep_last_n:
        for old in published_iterations(root)[:-keep_last_n]:
            if old != iteration:
                shutil.rmtree(os.path.join(root, iteration_dir_name(old)), ignore_errors=True)
                shutil.rmtree(os.path.join(root, iteration_dir_name(old)) + REPLACED_SUFFIX, ignore_errors=True)


def published_directory(root, iteration):
    """(directory of published checkpoint `iteration` under `root`, None) or, when a save of the same iteration
    was killed between its two renames, (its `.replaced` copy, the missing directory). Reads only."""
    directory = os.path.join(root, iteration_dir_name(iteration))
    if os.path.isdir(directory):
        return directory, None
    if os.path.isdir(directory + REPLACED_SUFFIX):
        return directory + REPLACED_SUFFIX, directory
    published = published_iterations(root)
    choices = ", ".join(map(str, published))
    advice = (f"load one of the checkpoints there with --load {root} --ckpt-step N (N: {choices}), or write one of "
              "those iterations into the tracker" if published else
              f"there is no checkpoint under {root}: remove the tracker to start from scratch, or --load another "
              "directory")
    raise CheckpointError(
        f"{os.path.join(root, TRACKER_FILENAME)} names iteration {iteration}, but {directory} does not exist (nor "
        f"a {REPLACED_SUFFIX} copy of it); {advice}")

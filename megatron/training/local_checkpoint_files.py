"""The files of `--non-persistent-ckpt-type local` checkpoints under `--non-persistent-local-ckpt-dir DIR`.

    DIR/rank_00001/iter_0000006/          rank 1's part of the local checkpoint of iteration 6
        state.pt                          its tensors (pieces) and objects (torch.save)
        metadata.json                     iteration, rank, world size, layout, algorithm, save id
    DIR/rank_00001/iter_0000008.tmp/      a save in progress, or one that was interrupted: never loaded

Each rank writes only its own directory (DIR may be node-local storage). A part is written into the `.tmp`
directory, its files flushed and fsynced, and then renamed into place: `iter_XXXXXXX/` exists only complete.
Plain file operations only (no torch.distributed).
"""

import json
import os
import re
import shutil

import torch

from megatron.core.dist_checkpointing.checkpoint_directory import TEMPORARY_SUFFIX, iteration_dir_name

STATE_FILENAME = "state.pt"
METADATA_FILENAME = "metadata.json"
FORMAT_NAME = "megatron_local_checkpoint"
_ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")  # 8 digits from iteration 10,000,000 on


def rank_dir(root, rank):
    return os.path.join(root, f"rank_{rank:05d}")


def checkpoint_dir(root, rank, iteration):
    return os.path.join(rank_dir(root, rank), iteration_dir_name(iteration))


def complete_iterations(root, rank):
    """Iterations of this rank's complete local checkpoints (renamed into place, both files present), ascending."""
    directory = rank_dir(root, rank)
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        match = _ITERATION_DIR.match(name)
        if match and all(os.path.isfile(os.path.join(directory, name, file))
                         for file in (STATE_FILENAME, METADATA_FILENAME)):
            found.append(int(match.group(1)))
    return sorted(found)


def _fsync_directory(path):
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    except OSError:  # some file systems cannot sync a directory
        pass
    finally:
        os.close(descriptor)


def _write_synced(path, write):
    with open(path, "wb") as stream:
        write(stream)
        stream.flush()
        os.fsync(stream.fileno())


def write(root, rank, iteration, payload, metadata):
    """Write this rank's part of checkpoint `iteration`: into `iter_XXXXXXX.tmp/`, fsynced, then renamed into
    place (replacing an older copy of the same iteration). Returns the final directory."""
    final = checkpoint_dir(root, rank, iteration)
    temporary = final + TEMPORARY_SUFFIX
    shutil.rmtree(temporary, ignore_errors=True)  # left by an interrupted save of this iteration
    os.makedirs(temporary)
    _write_synced(os.path.join(temporary, STATE_FILENAME), lambda stream: torch.save(payload, stream))
    document = json.dumps({"format": FORMAT_NAME, "version": 1, **metadata}, indent=1).encode()
    _write_synced(os.path.join(temporary, METADATA_FILENAME), lambda stream: stream.write(document))
    _fsync_directory(temporary)
    if os.path.exists(final):  # an older copy of this iteration: a kill in between leaves none, never a mix
        shutil.rmtree(final)
    os.replace(temporary, final)
    _fsync_directory(os.path.dirname(final))
    return final


def read_metadata(directory):
    with open(os.path.join(directory, METADATA_FILENAME)) as stream:
        return json.load(stream)


def read_state(directory):
    return torch.load(os.path.join(directory, STATE_FILENAME), map_location="cpu", weights_only=False)


def remove(root, rank, iteration):
    """Remove this rank's part of checkpoint `iteration`, complete or not."""
    directory = checkpoint_dir(root, rank, iteration)
    shutil.rmtree(directory, ignore_errors=True)
    shutil.rmtree(directory + TEMPORARY_SUFFIX, ignore_errors=True)


def remove_all_but(root, rank, iteration):
    """Remove every other entry of this rank's directory (older checkpoints, unfinished saves); returns their
    names."""
    directory = rank_dir(root, rank)
    keep = iteration_dir_name(iteration)
    removed = sorted(name for name in os.listdir(directory) if name != keep)
    for name in removed:
        path = os.path.join(directory, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)
    return removed

"""Upstream's calls that read a torch_dist checkpoint without a model or a process group:
`check_is_distributed_checkpoint`, `load_tensors_metadata` (each tensor's global shape and dtype),
`load_plain_tensors` (every tensor whole), `load_sharded_metadata` (tensors and ShardedObjects without data),
`load_content_metadata` (what `save(..., content_metadata=)` kept), and `remove_sharded_tensors`, which drops
tensors from a checkpoint's index.

A directory without the DCP index (`.metadata`) is refused with what it holds instead: a checkpoint root (whose
iteration directories are the checkpoints), a `torch`-format checkpoint, or anything else.
"""

import os
import pickle
import re
from typing import Dict, Optional

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron.core.dist_checkpointing import offline, serialization
from megatron.core.dist_checkpointing.checkpoint_directory import (
    TRACKER_FILENAME,
    iteration_dir_name,
    published_iterations,
    read_tracker,
)
from megatron.core.dist_checkpointing.errors import CheckpointError
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

_LISTED_ENTRIES = 8

# The common object holding `save(..., content_metadata=...)` (upstream's key).
CONTENT_METADATA_KEY = "content_metadata"


def check_is_distributed_checkpoint(checkpoint_dir) -> bool:
    """Whether `checkpoint_dir` is a torch_dist checkpoint (holds the DCP index)."""
    return os.path.isfile(os.path.join(str(checkpoint_dir), serialization.METADATA_FILENAME))


def _what_it_holds(directory: str) -> str:
    if not os.path.exists(directory):
        return "it does not exist"
    if not os.path.isdir(directory):
        return "it is a file, not a directory"
    entries = sorted(os.listdir(directory))
    if os.path.isfile(os.path.join(directory, TRACKER_FILENAME)):
        iterations = ", ".join(map(str, published_iterations(directory))) or "none"
        try:
            latest = os.path.join(directory, iteration_dir_name(read_tracker(directory)))
        except (ValueError, TypeError):
            latest = os.path.join(directory, "iter_NNNNNNN")
        return (f"it is a checkpoint root (with {TRACKER_FILENAME}; iterations there: {iterations}): pass one of "
                f"its iteration directories, such as the latest, {latest}")
    if any(entry.startswith("mp_rank_") for entry in entries):
        ranks = ", ".join(entry for entry in entries if entry.startswith("mp_rank_"))
        return (f"it holds a --ckpt-format torch checkpoint ({ranks}): convert it with "
                f"tools/checkpoint/convert_legacy.py --input {directory} --output NEW and read NEW")
    if not entries:
        return "it is empty"
    shown = ", ".join(entries[:_LISTED_ENTRIES]) + (", ..." if len(entries) > _LISTED_ENTRIES else "")
    return f"it holds {shown} ({len(entries)} entries)"


def checked_metadata(checkpoint_dir):
    """The DCP index of `checkpoint_dir`, or a CheckpointError naming the directory and what it holds."""
    directory = str(checkpoint_dir)
    if not check_is_distributed_checkpoint(directory):
        raise CheckpointError(f"{directory} is not a torch_dist checkpoint (it has no "
                              f"{serialization.METADATA_FILENAME} index): {_what_it_holds(directory)}")
    return serialization.read_metadata(directory)


def load_tensors_metadata(checkpoint_dir, sharded_strategy=None) -> Dict[str, ShardedTensor]:
    """{key: ShardedTensor without data} of every tensor of the checkpoint: its global shape and dtype, read from
    the index alone. `sharded_strategy` is accepted for upstream's signature (there is one torch_dist reader)."""
    items = checked_metadata(checkpoint_dir).state_dict_metadata.items()
    return {key: ShardedTensor(key, None, md.properties.dtype, tuple(md.size), tuple(md.size), (0,) * len(md.size),
                               (1,) * len(md.size)) for key, md in items if isinstance(md, TensorStorageMetadata)}


# `ShardedObject.unique_key`: "<key>/shard_<offset, dot-separated>_<shape, dot-separated>"
_SHARDED_OBJECT_KEY = re.compile(r"^(?P<key>.+)/shard_(?P<offset>\d+(?:\.\d+)*)_(?P<shape>\d+(?:\.\d+)*)$")


def load_sharded_metadata(checkpoint_dir, sharded_strategy=None, common_strategy=None) -> Dict[str, object]:
    """`load_tensors_metadata` plus, under each `ShardedObject.unique_key`, a ShardedObject without data (its
    key, global shape and offset) for every ShardedObject saved. The strategies are accepted for upstream's
    signature."""
    metadata = checked_metadata(checkpoint_dir)
    described = load_tensors_metadata(checkpoint_dir)
    for key in serialization.object_keys(metadata):
        match = _SHARDED_OBJECT_KEY.match(key)
        if match:
            offset = tuple(int(each) for each in match["offset"].split("."))
            shape = tuple(int(each) for each in match["shape"].split("."))
            if len(offset) == len(shape):
                described[key] = ShardedObject(match["key"], None, shape, offset)
    return described


def remove_sharded_tensors(checkpoint_dir, key_prefix: str) -> None:
    """Drop every tensor whose key starts with `key_prefix` from the checkpoint's index (by this process alone;
    the data files keep their bytes, which nothing reads any more)."""
    directory = str(checkpoint_dir)
    metadata = checked_metadata(directory)
    removed = {key for key, md in metadata.state_dict_metadata.items()
               if isinstance(md, TensorStorageMetadata) and key.startswith(key_prefix)}
    metadata.state_dict_metadata = {key: md for key, md in metadata.state_dict_metadata.items() if key not in removed}
    if metadata.storage_data is not None:
        metadata.storage_data = {index: info for index, info in metadata.storage_data.items()
                                 if index.fqn not in removed}
    path = os.path.join(directory, serialization.METADATA_FILENAME)
    with open(path + ".tmp", "wb") as index_file:
        pickle.dump(metadata, index_file)
    os.replace(path + ".tmp", path)


def load_plain_tensors(checkpoint_dir) -> Dict[str, torch.Tensor]:
    """{key: whole tensor} of every tensor of the checkpoint (no objects), read by this process alone."""
    keys = set(serialization.tensor_shapes(checked_metadata(checkpoint_dir)))
    return offline.read_checkpoint(str(checkpoint_dir), keys)


def load_content_metadata(checkpoint_dir=None, *, preloaded_state_dict=None) -> Optional[dict]:
    """The `content_metadata` saved with the checkpoint (from `preloaded_state_dict`, the common state, when
    given), or None when it has none."""
    if preloaded_state_dict is not None:
        return preloaded_state_dict.get(CONTENT_METADATA_KEY)
    if checkpoint_dir is None:
        raise ValueError("load_content_metadata needs checkpoint_dir or preloaded_state_dict")
    if CONTENT_METADATA_KEY not in serialization.object_keys(checked_metadata(checkpoint_dir)):
        return None
    return offline.read_checkpoint(str(checkpoint_dir), [CONTENT_METADATA_KEY])[CONTENT_METADATA_KEY]

"""Write and read a logical state dict with torch.distributed.checkpoint, with errors that name the file or tensor.

`save` writes a flat `{key: ShardedLogicalTensor | DTensor | tensor | picklable object}` dict into a directory
(each rank writes its own `__<rank>_0.distcp` file, the coordinator the `.metadata` index); identical pieces
offered by replicas are written once. `load` fills the same kind of dict in place from a checkpoint written at
any layout; `read_objects` returns the picklable objects. `TorchDistSaveShardedStrategy` and
`TorchDistLoadShardedStrategy` are upstream's strategy objects over the two, and
`get_default_save_sharded_strategy` / `get_default_load_sharded_strategy` upstream's way of asking for them.
"""

import contextlib
import os
import pickle
import warnings
from typing import Dict, Iterable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from megatron.core.dist_checkpointing import fp8_histories
from megatron.core.dist_checkpointing.checkpoint_directory import earlier_checkpoint_advice
from megatron.core.dist_checkpointing.errors import CheckpointError, CheckpointShapeError  # noqa: F401 (re-exported)
from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor
from megatron.core.dist_checkpointing.planners import LogicalLoadPlanner, LogicalSavePlanner
from megatron.core.dist_checkpointing.strictness import KeyMismatch
from megatron.core.fp8.checkpoint import history_length_error, is_amax_history_key

METADATA_FILENAME = ".metadata"


def _distributed():
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _alone(no_dist: bool):
    """DCP warns on every save or load without a process group, as if by accident; here it is asked for (a tool,
    or --use-checkpoint-args reading the arguments before the process group exists), so the warning is noise."""
    if not no_dist:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def damaged_data_files(directory: str):
    """['<path> is missing' | '<path> is truncated (...)'] for the data files the checkpoint's index points
    into: each must exist and reach the end of the last item the index places in it."""
    try:
        storage = dcp.FileSystemReader(directory).read_metadata().storage_data or {}
    except Exception:  # noqa: B902 - an unreadable index is reported by read_metadata itself
        return []
    needed = {}
    for info in storage.values():
        path = os.path.join(directory, info.relative_path)
        needed[path] = max(needed.get(path, 0), info.offset + info.length)
    problems = []
    for path, size in sorted(needed.items()):
        if not os.path.isfile(path):
            problems.append(f"{path} is missing")
        elif os.path.getsize(path) < size:
            problems.append(f"{path} is truncated ({os.path.getsize(path)} bytes; the index places data up to "
                            f"byte {size})")
    return problems


def _reraise(exc: BaseException, action: str, directory: str):
    """DCP reports per-rank failures as one CheckpointException; surface the first cause with the directory,
    and name the data files that are missing or truncated."""
    failures = getattr(exc, "failures", None) or {}
    causes = [cause[0] if isinstance(cause, tuple) else cause for cause in failures.values()]
    cause = causes[0] if causes else exc
    if isinstance(cause, CheckpointError):
        raise cause from None
    detail = f"{type(cause).__name__}: {cause}"
    if action == "write" and failures:
        detail = f"rank {', '.join(map(str, sorted(failures)))}: {detail}"
    damaged = damaged_data_files(directory) if action == "read" else []
    if damaged:
        detail = (f"a data file of this checkpoint is missing or damaged: {'; '.join(damaged)} ({detail}); "
                  f"{earlier_checkpoint_advice(directory)}")
    elif isinstance(cause, (FileNotFoundError, EOFError, pickle.UnpicklingError)) or "distcp" in str(cause):
        detail += " (a shard file of this checkpoint is missing or damaged)"
    raise CheckpointError(f"could not {action} checkpoint {directory}: {detail}") from cause


def save(state_dict: Dict[str, object], directory: str, process_group=None, thread_count: int = 1,
         single_process: bool = False):
    """Write `state_dict` into `directory` (collective over `process_group`, default: the world; by this
    process alone with `single_process`, e.g. a tool run inside a distributed job)."""
    writer = dcp.FileSystemWriter(directory, single_file_per_rank=True, thread_count=thread_count,
                                  sync_files=True, overwrite=True)
    no_dist = single_process or not _distributed()
    try:
        with _alone(no_dist):
            dcp.save(state_dict, storage_writer=writer, planner=LogicalSavePlanner(), process_group=process_group,
                     no_dist=no_dist)
    except CheckpointException as exc:
        _reraise(exc, "write", directory)


def read_metadata(directory: str):
    """The checkpoint's index, or a CheckpointError naming the missing or truncated file."""
    path = os.path.join(directory, METADATA_FILENAME)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} not found: {directory} is not a complete torch_dist checkpoint (an "
                              "interrupted save never publishes one; point --load at the root holding "
                              f"latest_checkpointed_iteration.txt); {earlier_checkpoint_advice(directory)}")
    try:
        return dcp.FileSystemReader(directory).read_metadata()
    except (EOFError, pickle.UnpicklingError, AttributeError, ValueError, IndexError) as exc:
        raise CheckpointError(f"{path} is truncated or damaged ({type(exc).__name__}: {exc}); "
                              f"{earlier_checkpoint_advice(directory)}") from exc


def tensor_shapes(metadata) -> Dict[str, torch.Size]:
    return {key: md.size for key, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}


def tensor_dtypes(metadata) -> Dict[str, torch.dtype]:
    return {key: md.properties.dtype for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}


def object_keys(metadata) -> Iterable[str]:
    return [key for key, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)]


def _target_shape(value):
    if isinstance(value, (ShardedLogicalTensor, DTensor)) or torch.is_tensor(value):
        return torch.Size(value.shape)
    return None


def check_shapes(targets: Dict[str, object], metadata, directory: str):
    """Every target tensor must have the saved logical shape: raise naming the tensor and both shapes. FP8 amax
    histories saved with another history length are no error: `load` fits them (see `fp8_histories`), nor is a
    ShardedTensor with `allow_shape_mismatch` (e.g. a padded tensor): it is filled where it overlaps the saved one."""
    saved = tensor_shapes(metadata)
    for key, value in targets.items():
        shape = _target_shape(value)
        if getattr(value, "allow_shape_mismatch", False):  # upstream's ShardedTensor: reads the overlap
            continue
        if shape is None or key not in saved or saved[key] == shape or fp8_histories.can_fit(key, value, saved[key]):
            continue
        if is_amax_history_key(key) and tuple(saved[key])[-1:] != tuple(shape)[-1:]:
            raise CheckpointShapeError(f"checkpoint {directory}: {history_length_error(key, saved[key], shape)}")
        raise CheckpointShapeError(
            f"checkpoint {directory}: tensor '{key}' has shape {tuple(saved[key])} in the checkpoint but "
            f"{tuple(shape)} in this model; the model configuration (e.g. --hidden-size, --num-attention-heads, "
            f"--ffn-hidden-size, --vocab-size) must match the one that wrote it")


def key_mismatch(targets: Dict[str, object], metadata, prefixes, process_group=None) -> KeyMismatch:
    """Tensor keys under `prefixes` that this rank needs but the checkpoint lacks (missing), and keys the
    checkpoint has that no rank needs (unexpected; collective: ranks agree on what the whole model needs)."""
    saved = {key for key in tensor_shapes(metadata) if key.startswith(tuple(prefixes))}
    wanted = {key for key, value in targets.items() if _target_shape(value) is not None}
    wanted_anywhere = set(wanted)
    if _distributed() and dist.get_world_size(process_group) > 1:
        gathered = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(gathered, sorted(saved - wanted), group=process_group)
        not_wanted_everywhere = set.intersection(*(set(keys) for keys in gathered))
        return KeyMismatch(sorted(wanted - saved), sorted(not_wanted_everywhere))
    return KeyMismatch(sorted(wanted - saved), sorted(saved - wanted_anywhere))


class _IndexedReader(dcp.FileSystemReader):
    """A reader handed the checkpoint's index as `read_metadata` returned it: one load of several parts parses
    `.metadata` once, not once per part."""

    def __init__(self, directory: str, metadata):
        super().__init__(directory)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs):
        if getattr(self._metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


def load(targets: Dict[str, object], directory: str, process_group=None, single_process: bool = False,
         metadata=None):
    """Fill `targets` in place from `directory` (collective: every rank calls it, also with nothing to load;
    this process alone with `single_process`). Objects come back as new values in `targets`. `metadata`: the
    directory's index from `read_metadata`, if the caller has it already. FP8 amax histories saved with another
    `--fp8-amax-history-len` are read at the saved shape and fitted to the model's (see `fp8_histories`)."""
    no_dist = single_process or not _distributed()
    if not targets and no_dist:
        return targets
    if metadata is None and any(is_amax_history_key(key) for key in targets):
        metadata = read_metadata(directory)
    staged = fp8_histories.stage(targets, tensor_shapes(metadata)) if metadata is not None else []
    reader = dcp.FileSystemReader(directory) if metadata is None else _IndexedReader(directory, metadata)
    try:
        with _alone(no_dist):
            dcp.load(targets, storage_reader=reader, planner=LogicalLoadPlanner(), process_group=process_group,
                     no_dist=no_dist)
    except CheckpointException as exc:
        _reraise(exc, "read", directory)
    except (FileNotFoundError, EOFError, RuntimeError, ValueError) as exc:
        _reraise(exc, "read", directory)
    fp8_histories.finish(targets, staged)
    return targets


def read_objects(directory: str, keys, process_group=None, metadata=None) -> Dict[str, object]:
    """The picklable objects saved under `keys` (every rank reads them)."""
    return load({key: None for key in keys}, directory, process_group, metadata=metadata)


class TorchDistSaveShardedStrategy:
    """Writes a sharded state dict with `save` (collective over `process_group`)."""

    backend = "torch_dist"

    def __init__(self, backend="torch_dist", version=1, thread_count=1, process_group=None):
        if backend != "torch_dist":
            raise ValueError(f"TorchDistSaveShardedStrategy writes the torch_dist format, not {backend!r}")
        self.thread_count = thread_count
        self.process_group = process_group

    def save(self, sharded_state_dict, checkpoint_dir):
        save(sharded_state_dict, str(checkpoint_dir), self.process_group, thread_count=self.thread_count)


class TorchDistLoadShardedStrategy:
    """Fills a sharded state dict in place with `load` (collective) and returns it."""

    def __init__(self, process_group=None):
        self.process_group = process_group

    def load(self, sharded_state_dict, checkpoint_dir):
        return load(sharded_state_dict, str(checkpoint_dir), self.process_group)


def get_default_save_sharded_strategy(backend: str = "torch_dist", version: int = 1) -> TorchDistSaveShardedStrategy:
    """The strategy `dist_checkpointing.save` uses by default; torch_dist is the one format written here."""
    if backend != "torch_dist":
        raise ValueError(f"checkpoint format {backend!r} is not supported: write 'torch_dist' "
                         "(--ckpt-format torch_dist)")
    return TorchDistSaveShardedStrategy(backend, version)


def get_default_load_sharded_strategy(checkpoint_dir=None) -> TorchDistLoadShardedStrategy:
    """The strategy `dist_checkpointing.load` uses by default (every torch_dist checkpoint is read the same way)."""
    return TorchDistLoadShardedStrategy()

"""Upstream's entry points `save`, `load` and `load_common_state_dict` over the torch_dist format.

`save` writes a sharded state dict (see `mapping`), flat or nested as training loops of their own build it
(`{"model": model.sharded_state_dict(), "iteration": 10, ...}`; see `nesting`): each rank its sharded entries,
under their own keys, and the first rank the rest (the common state), as objects. `load` fills the sharded
entries in place from a checkpoint written at any layout and returns the request's nesting with each
single-piece tensor as a plain tensor (so `model.load_state_dict(load(...)["model"])` works, as upstream) and
the common state as saved; `strict` (`--dist-ckpt-strictness`) applies to the tensor keys of the whole nesting.
`load_common_state_dict` returns every object the checkpoint holds (the state all ranks share). Upstream's
`ShardedTensor` and `ShardedObject` (see `mapping`) are sharded entries under their own keys: each rank saves its
ShardedObjects (the main replica's) and `load` returns their saved data.
"""

import os
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import nesting, serialization
from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy
from megatron.core.dist_checkpointing.strictness import KeyMismatch, apply_strictness
from megatron.core.dist_checkpointing.validation import StrictHandling, parse_strict_flag


def _save_strategy(sharded_strategy):
    if sharded_strategy is None:
        return TorchDistSaveShardedStrategy()
    if isinstance(sharded_strategy, tuple):  # (backend, version), as upstream accepts
        return TorchDistSaveShardedStrategy(*sharded_strategy)
    return sharded_strategy


def _writes_common_state(process_group) -> bool:
    """The common state is the first rank's (upstream writes it from rank 0 alone)."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank(process_group) == 0


# The common object holding `save(..., content_metadata=...)` (upstream's key); see `inspection`.
CONTENT_METADATA_KEY = "content_metadata"


_NOT_WRITTEN = object()


class _TensorObject(NamedTuple):
    """A ShardedObject's tensor data, pickled as an object (DCP would save a bare tensor as a tensor)."""

    tensor: torch.Tensor


def _saved_value(value):
    """What serialization writes for a sharded entry: a ShardedObject's data (from its main replica alone)."""
    if not isinstance(value, ShardedObject):
        return value
    if not is_main_replica(value.replica_id):
        return _NOT_WRITTEN
    return _TensorObject(value.data) if torch.is_tensor(value.data) else value.data


def save(sharded_state_dict, checkpoint_dir, sharded_strategy=None, common_strategy=None,
         validate_access_integrity=True, content_metadata=None):
    """Write `sharded_state_dict` into `checkpoint_dir` (collective over the world, or the strategy's group);
    `content_metadata` (a dict describing the content) is kept for `load_content_metadata`."""
    if common_strategy is not None:
        raise ValueError("a separate common-state strategy is not used: common objects are saved as objects")
    strategy = _save_strategy(sharded_strategy)  # refuses an unknown format before anything is written
    parts = nesting.split(sharded_state_dict)
    flat = {key: _saved_value(value) for key, value in parts.sharded.items()}
    flat = {key: value for key, value in flat.items() if value is not _NOT_WRITTEN}
    if _writes_common_state(getattr(strategy, "process_group", None)):
        flat.update(parts.common)
        if content_metadata is not None:
            flat[CONTENT_METADATA_KEY] = content_metadata
    os.makedirs(str(checkpoint_dir), exist_ok=True)
    strategy.save(flat, checkpoint_dir)


def load(sharded_state_dict, checkpoint_dir, sharded_strategy=None, common_strategy=None,
         validate_access_integrity=True, strict=StrictHandling.ASSUME_OK_UNEXPECTED):
    """Fill the sharded entries of `sharded_state_dict` in place from `checkpoint_dir` (collective) and return
    its nesting with them and the saved common state. Tensor keys the checkpoint lacks, top-level common entries
    it lacks, and tensor keys it has that no rank asks for are handled by `strict` (a `StrictHandling`, its value,
    or a bool); with `return_unexpected` / `return_all` the result is `(state dict, missing keys, unexpected
    keys)` in upstream's sense: missing = checkpoint keys no rank asks for (empty under `return_unexpected`),
    unexpected = keys asked for that the checkpoint lacks."""
    if common_strategy is not None:
        raise ValueError("a separate common-state strategy is not used: common objects are saved as objects")
    mode = parse_strict_flag(strict)
    strategy = sharded_strategy if sharded_strategy is not None else TorchDistLoadShardedStrategy()
    directory = str(checkpoint_dir)
    request = nesting.split(sharded_state_dict)
    metadata = serialization.read_metadata(directory)
    saved_objects = set(serialization.object_keys(metadata))
    saved_as = _saved_tensor_keys(request.sharded, set(serialization.tensor_shapes(metadata)))
    sharded = {saved_as[key]: value for key, value in request.sharded.items()}
    tensors = serialization.key_mismatch(sharded, metadata, [""], getattr(strategy, "process_group", None))
    entry_objects = _objects_saved_apart(request.common, saved_objects)
    missing_common = [str(key) for key in request.common_with_values
                      if key not in saved_objects and key not in entry_objects]
    missing_common += [key for key, value in sharded.items()  # ShardedObjects are objects of the checkpoint
                       if isinstance(value, ShardedObject) and key not in saved_objects]
    mismatch = KeyMismatch(sorted(tensors.missing + missing_common), tensors.unexpected)
    apply_strictness(mode, mismatch, directory)
    targets = {key: None if isinstance(value, ShardedObject) else value for key, value in sharded.items()
               if key not in tensors.missing and key not in missing_common}
    targets.update({key: None for key in request.common if key in saved_objects})
    targets.update({str(entry): None for entries in entry_objects.values() for entry in entries})
    serialization.check_shapes(targets, metadata, directory)
    loaded = strategy.load(targets, checkpoint_dir)
    loaded_sharded = {key: _local_tensor(loaded[saved_as[key]]) for key in request.sharded if saved_as[key] in targets}
    loaded_common = {key: loaded[key] for key in request.common if key in saved_objects}
    loaded_common.update({key: {**request.common[key], **{entry: loaded[str(entry)] for entry in entries}}
                          for key, entries in entry_objects.items()})
    result = nesting.assemble(sharded_state_dict, request, loaded_common, loaded_sharded)
    if mode in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL):
        # Upstream's names: missing = checkpoint keys no rank asked for (only return_all looks for them),
        # unexpected = keys asked for that the checkpoint lacks.
        unasked = set(mismatch.unexpected) if mode is StrictHandling.RETURN_ALL else set()
        return result, unasked, set(mismatch.missing)
    return result


# pretrain_gpt.py's checkpoints (`--ckpt-format torch_dist`) hold the model's tensors under this prefix.
TRAINING_MODEL_PREFIX = "model."


def _saved_tensor_keys(sharded, saved_tensors):
    """{requested key: the key it is read from}: the key itself, or for a model tensor of a pretrain_gpt
    checkpoint, which holds `model.<logical name>` where `model.sharded_state_dict()` asks for the logical name,
    that prefixed key (as upstream, a tensor is found by its own key wherever it sits in the request)."""
    saved_as = {}
    for key in sharded:
        prefixed = TRAINING_MODEL_PREFIX + key
        use_prefixed = key not in saved_tensors and prefixed in saved_tensors and prefixed not in sharded
        saved_as[key] = prefixed if use_prefixed else key
    return saved_as


def _objects_saved_apart(common, saved_objects):
    """{top-level key the checkpoint lacks: its dict's entries that the checkpoint holds as top-level objects}: a
    pretrain_gpt checkpoint saves `optimizer.step`, `optimizer.param_groups` and `optimizer.grad_scaler` on their
    own, where a nested request holds them in the optimizer's dict."""
    found = {}
    for key, value in common.items():
        if key in saved_objects or not isinstance(value, dict):
            continue
        entries = [entry for entry in value if str(entry) in saved_objects and entry not in common]
        if entries:
            found[key] = entries
    return found


def _local_tensor(value):
    """A `ShardedLogicalTensor` of one piece as that piece (the rank's tensor, as upstream's load returns it, so
    `module.load_state_dict` takes the result; a ShardedTensor's `data`); several pieces (flat
    distributed-optimizer ranges) stay as they are, filled in place."""
    if isinstance(value, ShardedTensor) and value.data is not None:
        return value.data.detach()
    if isinstance(value, _TensorObject):
        return value.tensor
    if isinstance(value, ShardedLogicalTensor) and len(value.pieces) == 1:
        return value.pieces[0][1].detach()
    return value


def load_common_state_dict(checkpoint_dir):
    """Every picklable object saved in `checkpoint_dir`, by key."""
    metadata = serialization.read_metadata(str(checkpoint_dir))
    objects = serialization.read_objects(str(checkpoint_dir), serialization.object_keys(metadata), metadata=metadata)
    return {key: value.tensor if isinstance(value, _TensorObject) else value for key, value in objects.items()}

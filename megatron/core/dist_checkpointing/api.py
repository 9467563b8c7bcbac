"""Upstream's entry points `save`, `load` and `load_common_state_dict` over the torch_dist format.

`save` writes a sharded state dict (see `mapping`), flat or nested as training loops of their own build it
(`{"model": model.sharded_state_dict(), "iteration": 10, ...}`; see `nesting`): each rank its sharded entries,
under their own keys, and the first rank the rest (the common state), as objects. `load` fills the sharded
entries in place from a checkpoint written at any layout and returns the request's nesting with each
single-piece tensor as a plain tensor (so `model.load_state_dict(load(...)["model"])` works, as upstream) and
the common state as saved; `strict` (`--dist-ckpt-strictness`) applies to the tensor keys of the whole nesting.
`load_common_state_dict` returns every object the checkpoint holds (the state all ranks share). Upstream's
`ShardedTensor` and `ShardedObject` (see `mapping`) are sharded entries under their own keys: each rank saves its
ShardedObjects (the main replica's) and `load` returns their saved data. As upstream, both build
`ShardedTensorFactory`s in place (`load` returns their `merge_fn` of what was read), leave
`LocalNonpersistentObject`s out of the checkpoint (`load` returns their objects), and `save` checks first that the
ranks' ShardedTensors tile each tensor (`validate_access_integrity`, see `access_integrity`).
"""

import os
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import nesting, offline, serialization
from megatron.core.dist_checkpointing.access_integrity import validate_sharding_integrity
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace, nested_values
from megatron.core.dist_checkpointing.inspection import CONTENT_METADATA_KEY, checked_metadata
from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    is_main_replica,
)
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
         validate_access_integrity=True, async_sharded_save=False, preprocess_common_before_consistancy_check=None,
         content_metadata=None):
    """Write `sharded_state_dict` into `checkpoint_dir` (collective over the world, or the strategy's group);
    `content_metadata` (a dict describing the content) is kept for `load_content_metadata`. The common state is
    the first rank's, so `preprocess_common_before_consistancy_check` (upstream's hook for comparing it across
    ranks) is accepted and not needed."""
    if common_strategy is not None:
        raise ValueError("a separate common-state strategy is not used: common objects are saved as objects")
    if async_sharded_save:
        raise ValueError("save(async_sharded_save=True) is not supported by megatron.core.dist_checkpointing: call "
                         "save() synchronously, or let the training loop write in the background (--async-save)")
    strategy = _save_strategy(sharded_strategy)  # refuses an unknown format before anything is written
    apply_factories(sharded_state_dict)  # in place, as upstream
    parts = nesting.split(_persistent(sharded_state_dict))
    if validate_access_integrity:
        validate_sharding_integrity(parts.sharded, getattr(strategy, "process_group", None))
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
    factories = dict_list_map_outplace(lambda value: value if isinstance(value, ShardedTensorFactory) else None,
                                       sharded_state_dict)
    local_objects = dict_list_map_outplace(lambda value: value if isinstance(value, LocalNonpersistentObject)
                                           else None, sharded_state_dict)
    apply_factories(sharded_state_dict)  # in place, as upstream
    sharded_state_dict = _persistent(sharded_state_dict)
    request = nesting.split(sharded_state_dict)
    metadata = checked_metadata(directory)
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
    saved_shapes = serialization.tensor_shapes(metadata)
    targets.update({key: _overlap_with_saved(value, saved_shapes[key]) for key, value in targets.items()
                    if getattr(value, "allow_shape_mismatch", False) and key in saved_shapes})
    loaded = strategy.load(targets, checkpoint_dir)
    loaded_sharded = {key: _local_tensor(value if getattr(value, "allow_shape_mismatch", False)
                                         else loaded[saved_as[key]])
                      for key, value in request.sharded.items() if saved_as[key] in targets}
    loaded_common = {key: loaded[key] for key in request.common if key in saved_objects}
    loaded_common.update({key: {**request.common[key], **{entry: loaded[str(entry)] for entry in entries}}
                          for key, entries in entry_objects.items()})
    result = nesting.assemble(sharded_state_dict, request, loaded_common, loaded_sharded)
    _merge_factories_and_local_objects(result, factories, local_objects)
    if mode in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL):
        # Upstream's names: missing = checkpoint keys no rank asked for (only return_all looks for them),
        # unexpected = keys asked for that the checkpoint lacks.
        unasked = set(mismatch.unexpected) if mode is StrictHandling.RETURN_ALL else set()
        return result, unasked, set(mismatch.missing)
    return result


def _persistent(state_dict):
    """`state_dict` without its `LocalNonpersistentObject`s (dropped from dicts, None in lists); containers
    are copied, values are not."""
    if isinstance(state_dict, dict):
        return {key: _persistent(value) for key, value in state_dict.items()
                if not isinstance(value, LocalNonpersistentObject)}
    if isinstance(state_dict, list):
        return [None if isinstance(value, LocalNonpersistentObject) else _persistent(value) for value in state_dict]
    return state_dict


def _merge_factories_and_local_objects(result, factories, local_objects):
    """In the loaded `result`, a `ShardedTensorFactory` of the request (at its place in `factories`) becomes its
    `merge_fn` of what was loaded for the state dict it built, and a `LocalNonpersistentObject` (in
    `local_objects`) its object."""
    items = factories.items() if isinstance(factories, dict) else enumerate(factories)
    for key, factory in items:
        local_object = local_objects[key]
        if isinstance(local_object, LocalNonpersistentObject):
            if isinstance(result, list):
                result.extend([None] * (key + 1 - len(result)))
            result[key] = local_object.unwrap()
        elif isinstance(factory, ShardedTensorFactory):
            if isinstance(result, dict) and key not in result:
                continue  # not loaded (strictness let it be absent)
            result[key] = factory.merge_fn(result[key])
        elif isinstance(factory, (dict, list)) and _holds_any(factory, local_object):
            if isinstance(result, dict) and key not in result:
                result[key] = [] if isinstance(factory, list) else {}
            _merge_factories_and_local_objects(result[key], factory, local_object)


def _holds_any(*trees) -> bool:
    return any(value is not None for tree in trees for value in nested_values(tree))


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


def _overlap_with_saved(value: ShardedLogicalTensor, saved_shape) -> ShardedLogicalTensor:
    """A ShardedTensor with `allow_shape_mismatch` as the views of its pieces that lie inside the saved tensor,
    in a logical tensor of the saved shape: loading fills those and leaves the rest (padding) as it is."""
    pieces = []
    for offsets, tensor in value.pieces:
        sizes = [max(0, min(size, full - offset)) for offset, size, full in zip(offsets, tensor.shape, saved_shape)]
        pieces.append((offsets, tensor[tuple(slice(0, size) for size in sizes)]))
    return ShardedLogicalTensor(saved_shape, pieces, dtype=value.dtype)


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
    """Every picklable object saved in `checkpoint_dir`, by key, read by this process alone (as upstream, which
    reads its common file: any rank, or a tool, may call it without the others)."""
    keys = serialization.object_keys(checked_metadata(checkpoint_dir))
    objects = offline.read_checkpoint(str(checkpoint_dir), keys)
    return {key: value.tensor if isinstance(value, _TensorObject) else value for key, value in objects.items()}

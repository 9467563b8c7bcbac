"""Logical checkpoints without a process group: read every tensor whole, or write whole tensors.

For tools (inspect, convert): one process reads any checkpoint however many ranks wrote it, and writes a
checkpoint that any layout can load (each tensor as one chunk); also from one rank of a distributed job.
"""

import os
import warnings
from typing import Dict, Tuple

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron.core.dist_checkpointing import serialization
from megatron.core.dist_checkpointing.checkpoint_directory import TEMPORARY_SUFFIX, iteration_dir_name, publish


def _quietly(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        return fn(*args, **kwargs)


def read_checkpoint(directory: str, keys=None) -> Dict[str, object]:
    """{key: full tensor or object} of the checkpoint in `directory` (all keys, or `keys`)."""
    metadata = serialization.read_metadata(directory)
    targets = {}
    for key, md in metadata.state_dict_metadata.items():
        if keys is not None and key not in keys:
            continue
        if isinstance(md, TensorStorageMetadata):
            targets[key] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            targets[key] = None
    return _quietly(serialization.load, targets, directory, single_process=True)


def describe(directory: str):
    """[(key, shape or None, dtype or 'object', number of chunks)] from the checkpoint's index alone."""
    metadata = serialization.read_metadata(directory)
    rows = []
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            rows.append((key, tuple(md.size), str(md.properties.dtype).replace("torch.", ""), len(md.chunks)))
        else:
            rows.append((key, None, "object", 1))
    return rows


def write_checkpoint(root: str, iteration: int, state: Dict[str, object], layout: Dict[str, object]):
    """Publish `state` (whole tensors and objects) as checkpoint `iteration` under `root`, tracker last."""
    os.makedirs(root, exist_ok=True)
    temporary = os.path.join(root, iteration_dir_name(iteration) + TEMPORARY_SUFFIX)
    _quietly(serialization.save, state, temporary, single_process=True)
    publish(root, iteration, temporary, layout)


def split_state(state: Dict[str, object]) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor], dict]:
    """(model tensors by logical name, optimizer tensors by key, everything else) of a full checkpoint."""
    model = {key[len("model."):]: value for key, value in state.items()
             if key.startswith("model.") and torch.is_tensor(value)}
    optimizer = {key: value for key, value in state.items() if key.startswith("optimizer.") and torch.is_tensor(value)}
    rest = {key: value for key, value in state.items() if not (key.startswith("model.") and torch.is_tensor(value))
            and key not in optimizer}
    return model, optimizer, rest


def full_precision_model(state: Dict[str, object]) -> Dict[str, torch.Tensor]:
    """Model weights by logical name in fp32, taken from the fp32 main weights where the checkpoint has them."""
    model, optimizer, _ = split_state(state)
    result = {}
    for name, tensor in model.items():
        main = optimizer.get(f"optimizer.state.{name}.fp32_param")
        source = main if main is not None else tensor
        result[name] = source.float() if source.is_floating_point() else source
    return result

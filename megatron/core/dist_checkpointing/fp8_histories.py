"""Loading FP8 amax histories saved with another `--fp8-amax-history-len`.

The model's history buffers are `[3, this run's length]`, the checkpoint's `[3, saved length]`. Such a target is
read at the checkpoint's shape into staging storage of the same layout (the same rows of each piece, every saved
column), and after the read each piece of the model's buffer gets the fitted histories
(`megatron.core.fp8.checkpoint.fit_amax_history`: newest first, the newest kept, zeros past the saved ones).
A history target whose pieces split the length dim (no layout here does) cannot be staged so:
`check_shapes` then reports it naming `--fp8-amax-history-len` and both lengths.
"""

from typing import Dict, List, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor
from megatron.core.fp8.checkpoint import (
    fit_amax_history,
    history_length_changed,
    is_amax_history_key,
    report_history_length_change,
)


class StagedHistory(NamedTuple):
    """Checkpoint key `key`, whose model target `target` is read through `staging` (the saved shape)."""

    key: str
    target: object
    staging: object


def _pieces(target):
    """[(offsets, local tensor)] of a target: its pieces, or a plain tensor whole; None for other values."""
    if isinstance(target, ShardedLogicalTensor):
        return target.pieces
    if torch.is_tensor(target) and not isinstance(target, DTensor):
        return [(torch.Size([0] * target.dim()), target)]
    return None


def can_fit(key: str, target, saved_shape) -> bool:
    """Whether `target` (the model's) loads from histories of `saved_shape` by fitting their length."""
    if not is_amax_history_key(key) or not history_length_changed(saved_shape, target.shape):
        return False
    pieces = _pieces(target)
    length = target.shape[-1]
    return pieces is not None and all(offsets[-1] == 0 and tensor.shape[-1] == length for offsets, tensor in pieces)


def stage(targets: Dict[str, object], saved_shapes) -> List[StagedHistory]:
    """Replace each history target saved at another length by staging storage at the saved shape; returns what
    `finish` fits back into the model once the read has filled the staging."""
    staged = []
    for key, target in list(targets.items()):
        saved_shape = saved_shapes.get(key)
        if saved_shape is None or not can_fit(key, target, saved_shape):
            continue
        saved_length = saved_shape[-1]
        pieces = [(offsets, tensor.new_zeros(*tensor.shape[:-1], saved_length)) for offsets, tensor in _pieces(target)]
        if isinstance(target, ShardedLogicalTensor):
            staging = ShardedLogicalTensor(saved_shape, pieces, target.dtype)
        else:
            staging = pieces[0][1]
        targets[key] = staging
        staged.append(StagedHistory(key, target, staging))
    return staged


@torch.no_grad()
def finish(targets: Dict[str, object], staged: List[StagedHistory]) -> None:
    """Fit the staged histories into the model's buffers (in place) and put the model's targets back."""
    for key, target, staging in staged:
        for (_, live), (_, saved) in zip(_pieces(target), _pieces(staging)):
            live.copy_(fit_amax_history(saved, live.shape[-1]))
        targets[key] = target
        report_history_length_change(staging.shape[-1], target.shape[-1])

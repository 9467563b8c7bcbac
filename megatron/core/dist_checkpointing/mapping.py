"""Upstream's names for the shapes of (sharded) state dicts.

A sharded state dict maps checkpoint keys to `ShardedLogicalTensor`s (a rank's pieces of a logical tensor),
DTensors, plain tensors (saved whole) or picklable objects; see `serialization`. `ShardedTensor` and
`ShardedObject` are upstream's classes for the same: a `ShardedTensor` is a `ShardedLogicalTensor` of one piece
(the rank's `data`) saved under its own `key`; a `ShardedObject` is one rank's object of a grid of objects,
saved under its `unique_key`.
"""

import math
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor, flat_range_pieces

StateDict = Dict[str, Any]
ShardedStateDict = Dict[str, Any]
ReplicaId = Any  # an int or a tuple of ints; 0 (or all zeros) is the replica that writes

__all__ = ["LocalNonpersistentObject", "ShardedLogicalTensor", "ShardedObject", "ShardedStateDict", "ShardedTensor",
           "ShardedTensorFactory", "StateDict", "apply_factories", "is_main_replica"]


def is_main_replica(replica_id: ReplicaId) -> bool:
    return all(each == 0 for each in replica_id) if isinstance(replica_id, tuple) else replica_id == 0


class ShardedTensor(ShardedLogicalTensor):
    """`data` (a rank's tensor, or None for a description) placed at `global_offset` in a logical tensor of
    `global_shape`, saved under `key`. The first `prepend_axis_num` axes of the logical tensor are ones that
    `data` lacks (e.g. a layer index). Loading fills `data` in place. Identical pieces of replicas are written
    once whatever their `replica_id`."""

    def __init__(self, key: str, data: Optional[torch.Tensor], dtype: torch.dtype, local_shape: Sequence[int],
                 global_shape: Sequence[int], global_offset: Sequence[int],
                 axis_fragmentations: Optional[Sequence[int]] = None, replica_id: ReplicaId = 0,
                 prepend_axis_num: int = 0, allow_shape_mismatch: bool = False, flattened_range=None):
        if len(global_offset) != len(global_shape) or len(global_shape) != len(local_shape) + prepend_axis_num:
            raise ValueError(f"ShardedTensor '{key}': global_shape {tuple(global_shape)} and global_offset "
                             f"{tuple(global_offset)} need {len(local_shape)} + {prepend_axis_num} (prepended) axes")
        if flattened_range is not None:
            pieces = _flat_pieces(key, data, local_shape, global_offset, prepend_axis_num, flattened_range)
        else:
            pieces = [] if data is None else [(global_offset, data[(None,) * prepend_axis_num])]
        super().__init__(global_shape, pieces, dtype=dtype)
        self.key, self.data, self.replica_id = key, data, replica_id
        self.local_shape, self.global_offset = tuple(local_shape), tuple(global_offset)
        self.axis_fragmentations = None if axis_fragmentations is None else tuple(axis_fragmentations)
        self.prepend_axis_num, self.allow_shape_mismatch, self.flattened_range = (
            prepend_axis_num, allow_shape_mismatch, flattened_range)

    @classmethod
    def from_rank_offsets(cls, key: str, data: torch.Tensor, *rank_offsets: Tuple[int, int, int],
                          replica_id: ReplicaId = 0, prepend_axis_num: int = 0, flattened_range=None,
                          **init_kwargs) -> "ShardedTensor":
        """Each `(axis, rank on that axis, fragments along it)` says that `data` is that fragment of the logical
        tensor along `axis` (e.g. `(0, tp_rank, tp_size)` for a column-parallel weight)."""
        if flattened_range is not None:
            raise ValueError(f"ShardedTensor '{key}': from_rank_offsets takes the whole local tensor; for a flat "
                             "range of it use ShardedTensor.from_rank_offsets_flat(key, flat_data, local_shape, "
                             "*rank_offsets, flattened_range=slice(start, stop))")
        ndim = data.dim() + prepend_axis_num
        global_shape = [1] * prepend_axis_num + list(data.shape)
        global_offset, fragmentations = [0] * ndim, [1] * ndim
        for axis, axis_rank, fragments in rank_offsets:
            if not (0 <= axis < ndim and 0 <= axis_rank < fragments):
                raise ValueError(f"ShardedTensor '{key}': invalid rank offset {(axis, axis_rank, fragments)} for a "
                                 f"tensor of {ndim} axes (need 0 <= axis < {ndim} and 0 <= rank < fragments)")
            local_size = 1 if axis < prepend_axis_num else data.shape[axis - prepend_axis_num]
            global_shape[axis], global_offset[axis] = fragments * local_size, axis_rank * local_size
            fragmentations[axis] = fragments
        return cls(key, data, data.dtype, tuple(data.shape), tuple(global_shape), tuple(global_offset),
                   tuple(fragmentations), replica_id, prepend_axis_num, **init_kwargs)

    @classmethod
    def from_rank_offsets_flat(cls, key: str, data: torch.Tensor, non_flat_local_shape: Sequence[int],
                               *rank_offsets: Tuple[int, int, int], flattened_range: slice,
                               **kwargs) -> "ShardedTensor":
        """As `from_rank_offsets` for a local tensor of `non_flat_local_shape`, of which this rank holds the flat
        elements `flattened_range` (`data`, 1-D; e.g. a distributed-optimizer shard)."""
        layout = cls.from_rank_offsets(key, torch.empty(non_flat_local_shape, device="meta", dtype=data.dtype),
                                       *rank_offsets, **kwargs)
        return cls(key, data, data.dtype, layout.local_shape, tuple(layout.global_shape), layout.global_offset,
                   layout.axis_fragmentations, layout.replica_id, layout.prepend_axis_num,
                   layout.allow_shape_mismatch, flattened_range)

    def without_data(self) -> "ShardedTensor":
        return ShardedTensor(self.key, None, self.dtype, self.local_shape, self.global_shape, self.global_offset,
                             self.axis_fragmentations, self.replica_id, self.prepend_axis_num,
                             self.allow_shape_mismatch, self.flattened_range)

    def __repr__(self):
        return (f"ShardedTensor(key={self.key!r}, dtype={self.dtype}, local_shape={self.local_shape}, "
                f"global_shape={tuple(self.global_shape)}, global_offset={self.global_offset}, "
                f"replica_id={self.replica_id})")


def _flat_pieces(key, data, local_shape, global_offset, prepend_axis_num, flattened_range):
    """The pieces of a flat range `flattened_range` (`data`, 1-D) of a local tensor of `local_shape` placed at
    `global_offset` (whose first `prepend_axis_num` axes the local tensor lacks)."""
    if not isinstance(flattened_range, slice) or flattened_range.step not in (None, 1):
        raise ValueError(f"ShardedTensor '{key}': flattened_range must be a slice(start, stop) with step 1, got "
                         f"{flattened_range!r}")
    if data is None:
        return []
    start, stop = flattened_range.start or 0, flattened_range.stop
    if data.dim() != 1 or stop is None or not 0 <= start <= stop <= math.prod(local_shape):
        raise ValueError(f"ShardedTensor '{key}': with flattened_range {flattened_range} the data must be the 1-D "
                         f"elements [start, stop) of a local tensor of shape {tuple(local_shape)}; got data of shape "
                         f"{tuple(data.shape)}")
    return flat_range_pieces(data, (1,) * prepend_axis_num + tuple(local_shape), global_offset, start, stop)


class ShardedObject:
    """One rank's picklable `data` at `global_offset` in a grid of objects of `global_shape` (e.g. per
    (pipeline, tensor) rank), saved under `unique_key` by the rank whose `replica_id` is 0; loading returns
    the saved object."""

    def __init__(self, key: str, data: object, global_shape: Sequence[int], global_offset: Sequence[int],
                 replica_id: ReplicaId = 0):
        if len(global_shape) != len(global_offset):
            raise ValueError(f"ShardedObject '{key}': global_shape {tuple(global_shape)} and global_offset "
                             f"{tuple(global_offset)} need the same number of axes")
        self.key, self.data, self.replica_id = key, data, replica_id
        self.global_shape, self.global_offset = tuple(global_shape), tuple(global_offset)

    @property
    def unique_key(self) -> str:
        return (f"{self.key}/shard_{'.'.join(map(str, self.global_offset))}_"
                f"{'.'.join(map(str, self.global_shape))}")

    def without_data(self) -> "ShardedObject":
        return ShardedObject(self.key, None, self.global_shape, self.global_offset, self.replica_id)

    def __repr__(self):
        return f"ShardedObject(key={self.unique_key!r}, replica_id={self.replica_id})"


def checkpoint_key(value, own_key: str) -> str:
    """The key a sharded entry is saved under: a ShardedTensor's `key`, a ShardedObject's `unique_key` (as
    upstream), else the key of the dict holding it."""
    if isinstance(value, ShardedTensor):
        return value.key
    if isinstance(value, ShardedObject):
        return value.unique_key
    return own_key


class ShardedTensorFactory:
    """A tensor saved as the sharded state dict `build_fn(key, data, replica_id, flattened_range)` returns (e.g.
    a fused weight saved as its parts) and loaded back as `merge_fn(that state dict, loaded)`. `save` and `load`
    build it; `apply_factories` builds the factories of a sharded state dict in place."""

    def __init__(self, key: str, data: torch.Tensor, build_fn: Callable, merge_fn: Callable,
                 replica_id: ReplicaId = 0, flattened_range: Optional[slice] = None):
        self.key, self.data, self.build_fn, self.merge_fn = key, data, build_fn, merge_fn
        self.replica_id, self.flattened_range = replica_id, flattened_range

    def build(self):
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def without_data(self) -> "ShardedTensorFactory":
        return ShardedTensorFactory(self.key, None, self.build_fn, self.merge_fn, self.replica_id,
                                    self.flattened_range)

    def __repr__(self):
        return f"ShardedTensorFactory(key={self.key!r}, replica_id={self.replica_id})"


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replace, in place, every `ShardedTensorFactory` of a nested sharded state dict by what it builds."""
    dict_list_map_inplace(lambda value: value.build() if isinstance(value, ShardedTensorFactory) else value,
                          sharded_state_dict)


class LocalNonpersistentObject:
    """An object that stays with this rank: `save` leaves it out and `load` returns it (`unwrap()`) where the
    request holds it (e.g. a value each run computes for itself)."""

    def __init__(self, obj: object):
        self.obj = obj

    def unwrap(self) -> object:
        return self.obj

    def __repr__(self):
        return f"LocalNonpersistentObject({self.obj!r})"

"""One logical (full, unpartitioned) tensor, as the pieces of it that this rank holds.

A tensor-parallel partition is one box of the logical tensor (an offset along the partition dim); a
distributed-optimizer shard is a flat range of such a partition, which `flat_range_boxes` cuts into at most
`2 * ndim - 1` boxes, each contiguous in the flattened order. `ShardedLogicalTensor` lists the boxes with their
local storage and speaks torch.distributed.checkpoint's chunk protocol, so DCP writes every box as a chunk of
the logical tensor and, on load, fills each box from whatever chunks overlap it: any layout reads any other.
"""

import math
from typing import List, NamedTuple, Sequence, Tuple

import torch


class Box(NamedTuple):
    """`sizes` elements starting at `offsets`; `flat_start` is the flat index of its first element."""

    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    flat_start: int


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> List[Box]:
    """Boxes covering the flat elements `[start, end)` of a row-major tensor of `shape`, in flat order.

    Each box fixes the indices of the leading dims, spans a range of one dim and all of the trailing dims, so
    its elements are contiguous in the flattened tensor.
    """
    shape = tuple(int(size) for size in shape)
    total = math.prod(shape)
    if not 0 <= start <= end <= total:
        raise ValueError(f"flat range [{start}, {end}) is outside a tensor of {total} elements (shape {shape})")
    if start == end:
        return []
    if not shape:
        return [Box((), (), 0)]
    inner = math.prod(shape[1:])
    first_row, first_offset = divmod(start, inner)
    last_row, last_offset = divmod(end, inner)

    def in_row(row, row_start, row_end):
        return [Box((row,) + box.offsets, (1,) + box.sizes, row * inner + box.flat_start)
                for box in flat_range_boxes(shape[1:], row_start, row_end)]

    if first_row == last_row:
        return in_row(first_row, first_offset, last_offset)
    boxes = []
    if first_offset:
        boxes += in_row(first_row, first_offset, inner)
        first_row += 1
    if last_row > first_row:
        boxes.append(Box((first_row,) + (0,) * (len(shape) - 1), (last_row - first_row,) + shape[1:],
                         first_row * inner))
    if last_offset:
        boxes += in_row(last_row, 0, last_offset)
    return boxes


class ShardedLogicalTensor:
    """Pieces `(global offsets, local tensor)` of a logical tensor of `global_shape`.

    Pieces of different ranks must tile the logical tensor when saving (identical pieces held by replicas are
    written once); when loading, each piece is filled in place from the checkpoint, whatever layout wrote it.
    """

    @classmethod
    def from_local(cls, tensor: torch.Tensor, global_shape: Sequence[int] = None,
                   base_offsets: Sequence[int] = None) -> "ShardedLogicalTensor":
        """The part of `tensor` this rank holds (a plain tensor whole, a DTensor its local shard), as a piece of
        the logical tensor of `global_shape` (default: `tensor`'s own shape) placed at `base_offsets`."""
        offsets, local = local_part(tensor)
        if base_offsets is not None:
            offsets = tuple(a + b for a, b in zip(offsets, base_offsets))
        shape = tensor.shape if global_shape is None else global_shape
        return cls(shape, [(offsets, local)], dtype=tensor.dtype)

    @classmethod
    def from_flat_range(cls, flat: torch.Tensor, global_shape: Sequence[int], local_shape: Sequence[int],
                        partition_offsets: Sequence[int], start: int, end: int) -> "ShardedLogicalTensor":
        """A flat range `[start, end)` (`flat`, e.g. a distributed-optimizer shard) of a partition of
        `local_shape` placed at `partition_offsets` in the logical tensor of `global_shape`."""
        return cls(global_shape, flat_range_pieces(flat.view(-1), local_shape, partition_offsets, start, end),
                   dtype=flat.dtype)

    def __init__(self, global_shape: Sequence[int], pieces: Sequence[Tuple[Sequence[int], torch.Tensor]],
                 dtype: torch.dtype = None):
        self.global_shape = torch.Size(global_shape)
        self.pieces = [(torch.Size(offsets), tensor) for offsets, tensor in pieces if tensor.numel() > 0]
        for offsets, tensor in self.pieces:
            if len(offsets) != len(self.global_shape) or tensor.dim() != len(self.global_shape) or any(
                    offset + size > full for offset, size, full in zip(offsets, tensor.shape, self.global_shape)):
                raise ValueError(f"piece of shape {tuple(tensor.shape)} at {tuple(offsets)} does not fit in a "
                                 f"logical tensor of shape {tuple(self.global_shape)}")
        self.dtype = dtype if dtype is not None else (self.pieces[0][1].dtype if self.pieces else torch.float32)

    # ---- the tensor-like surface DCP's planners read -------------------------------------------------------
    def size(self):
        return self.global_shape

    @property
    def shape(self):
        return self.global_shape

    def __create_write_items__(self, fqn, obj):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=tensor.shape),
                                                      properties=TensorProperties.create_from_tensor(tensor),
                                                      size=self.global_shape))
                for offsets, tensor in self.pieces]

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=offsets, sizes=tensor.shape) for offsets, tensor in self.pieces]

    def piece_at(self, offsets) -> torch.Tensor:
        offsets = torch.Size(offsets)
        for piece_offsets, tensor in self.pieces:
            if piece_offsets == offsets:
                return tensor
        raise KeyError(f"no piece at offsets {tuple(offsets)} (pieces: {[tuple(o) for o, _ in self.pieces]})")

    def staged(self) -> "ShardedLogicalTensor":
        """A copy whose pieces live in fresh CPU memory (a snapshot for a background write)."""
        return ShardedLogicalTensor(self.global_shape,
                                    [(offsets, tensor.detach().to("cpu", copy=True).contiguous())
                                     for offsets, tensor in self.pieces], self.dtype)

    def leading_rows(self, rows: int, global_rows: int) -> "ShardedLogicalTensor":
        """The parts of the pieces in rows `[0, rows)`, as views, in a logical tensor of `global_rows` rows (the
        trailing dims unchanged): loading into it fills those rows in place and leaves the others as they are."""
        if not 0 <= rows <= min(global_rows, self.global_shape[0]):
            raise ValueError(f"rows [0, {rows}) do not fit both {tuple(self.global_shape)} and {global_rows} rows")
        pieces = [(offsets, tensor[:max(0, rows - offsets[0])]) for offsets, tensor in self.pieces]
        return ShardedLogicalTensor((global_rows,) + tuple(self.global_shape[1:]), pieces, self.dtype)

    def rows_from(self, first_row: int) -> List[torch.Tensor]:
        """Views of the pieces' parts in rows `[first_row, ...)`."""
        views = [tensor[max(0, first_row - offsets[0]):] for offsets, tensor in self.pieces]
        return [view for view in views if view.numel() > 0]

    def __repr__(self):
        return f"ShardedLogicalTensor(shape={tuple(self.global_shape)}, pieces={len(self.pieces)}, dtype={self.dtype})"


def local_part(tensor):
    """(offsets of the locally held block within `tensor`, that block): a DTensor's local shard and where its
    placements put it (FSDP2 and Megatron-FSDP shards), or a plain tensor whole."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        chunks = tensor.__create_chunk_list__()  # empty pieces are dropped by ShardedLogicalTensor
        offsets = tuple(int(o) for o in chunks[0].offsets) if chunks else tuple([0] * tensor.dim())
        return offsets, tensor.to_local()
    return tuple([0] * tensor.dim()), tensor


def flat_range_pieces(flat: torch.Tensor, local_shape, partition_offsets, start, end):
    """Pieces of a flat range `[start, end)` of a partition of `local_shape` placed at `partition_offsets`.

    `flat` holds exactly the elements of the range (it is a shard, 1-D, of length `end - start`).
    """
    if flat.numel() != end - start:
        raise ValueError(f"flat shard has {flat.numel()} elements, the range [{start}, {end}) needs {end - start}")
    pieces = []
    for box in flat_range_boxes(local_shape, start, end):
        count = math.prod(box.sizes)
        first = box.flat_start - start
        offsets = tuple(o + p for o, p in zip(box.offsets, partition_offsets))
        pieces.append((offsets, flat[first:first + count].view(box.sizes)))
    return pieces

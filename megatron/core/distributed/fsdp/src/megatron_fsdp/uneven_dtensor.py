"""DTensors for checkpointing flat-sharded parameters.

A rank's flat shard of a parameter is generally not a rectangular block, so checkpoints use a different,
rectangular split: rows of dim 0, cut the way DTensor's `Shard(0)` cuts them (`ceil(rows / DP)` rows per rank,
trailing ranks fewer or none). Such DTensors carry standard metadata, so torch.distributed.checkpoint can
save them at one data-parallel size and load them at another. 0-dim tensors are replicated.

With tensor parallelism a parameter holds only its TP partition (an equal split along `partition_dim`). Its
DTensor has the full, unpartitioned shape and is placed `Shard(partition_dim)` over the tp mesh dim, which comes
before the data-parallel dim, so DTensor cuts the full tensor into TP partitions first and each partition into
rows second: the local part is still this rank's rows of its TP partition.
"""

from typing import Optional, Tuple

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from .dtensor_views import dtensor_over_view
from .layout import chunk_rows


def contiguous_stride(shape) -> Tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


def row_range(shape, dp_size: int, dp_rank: int) -> Tuple[int, int]:
    """Rows `[start, end)` of a tensor of `shape` this rank holds in a checkpoint (all of a 0-dim tensor on
    rank 0 only, so that sums over ranks count it once)."""
    if len(shape) == 0:
        return (0, 1) if dp_rank == 0 else (0, 0)
    return chunk_rows(shape[0], dp_size, dp_rank)


def row_slice_of_flat(flat: torch.Tensor, shape, dp_size: int, dp_rank: int) -> torch.Tensor:
    """This rank's rows of a full parameter given as a flat tensor."""
    if len(shape) == 0:
        return flat.view(())
    start, end = chunk_rows(shape[0], dp_size, dp_rank)
    row_numel = flat.numel() // shape[0] if shape[0] else 0
    return flat[start * row_numel:end * row_numel].view((end - start,) + tuple(shape[1:]))


def tensor_parallel_full_shape(local_shape, partition_dim: Optional[int], tp_size: int) -> Tuple[int, ...]:
    """The unpartitioned shape of a parameter whose TP partition has `local_shape` (itself if not partitioned)."""
    shape = list(local_shape)
    if partition_dim is not None:
        shape[partition_dim] *= tp_size
    return tuple(shape)


def make_row_sharded_dtensor(local_rows: torch.Tensor, global_shape, mesh, shard_mesh_dim: int,
                             tp_mesh_dim: Optional[int] = None, tp_partition_dim: Optional[int] = None) -> DTensor:
    """A DTensor of `global_shape` whose local part is this rank's rows, sharded over `shard_mesh_dim` of
    `mesh` (and `Shard(tp_partition_dim)` over `tp_mesh_dim`, which must come first, for a TP partition) and
    replicated over its other dims."""
    global_shape = torch.Size(global_shape)
    placements = [Replicate()] * mesh.ndim
    if len(global_shape) > 0:
        placements[shard_mesh_dim] = Shard(0)
    if tp_partition_dim is not None:
        if tp_mesh_dim is None or tp_mesh_dim >= shard_mesh_dim:
            raise ValueError(f"the tp mesh dim ({tp_mesh_dim}) must come before the data-parallel mesh dim "
                             f"({shard_mesh_dim}) so that rows are cut from each TP partition")
        placements[tp_mesh_dim] = Shard(tp_partition_dim)
    return dtensor_over_view(local_rows.contiguous(), mesh, placements, global_shape, contiguous_stride(global_shape))


def tensor_parallel_partition_of(value, local_shape, partition_dim: Optional[int], tp_size: int, tp_rank: int,
                                 dp_size: int, dp_rank: int):
    """A checkpoint value of a parameter whose TP partition has `local_shape` -> what `local_rows_of` takes.

    A sharded DTensor must have the full shape and hold this rank's rows of its partition; it is returned as is.
    A replicated DTensor or a plain tensor of the full shape is cut to this rank's partition."""
    full_shape = tensor_parallel_full_shape(local_shape, partition_dim, tp_size)
    if isinstance(value, DTensor):
        if tuple(value.shape) != full_shape:
            raise ValueError(f"checkpoint DTensor of shape {tuple(value.shape)} does not match the parameter's full "
                             f"(tensor-parallel unpartitioned) shape {full_shape}")
        if all(isinstance(p, Replicate) for p in value.placements):
            value = value.to_local()
        else:
            start, end = row_range(local_shape, dp_size, dp_rank)
            expected = (end - start,) + tuple(local_shape[1:]) if len(local_shape) else ()
            if tuple(value.to_local().shape) != expected:
                raise ValueError(f"checkpoint DTensor holds a {tuple(value.to_local().shape)} block of "
                                 f"{full_shape} on this rank, not its {expected} rows of its tensor-parallel "
                                 "partition; build the target state dict on the loading model (then dcp.load)")
            return value
    if tuple(value.shape) != full_shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(value.shape)} does not match the parameter's full "
                         f"(tensor-parallel unpartitioned) shape {full_shape}")
    if partition_dim is None:
        return value
    size = local_shape[partition_dim]
    return value.narrow(partition_dim, tp_rank * size, size)


def local_rows_of(value, global_shape, dp_size: int, dp_rank: int) -> torch.Tensor:
    """This rank's rows from a checkpoint value: a row-sharded DTensor at this DP size, or a full tensor."""
    if isinstance(value, DTensor):
        if all(isinstance(p, Replicate) for p in value.placements):
            value = value.to_local()
        else:
            local = value.to_local()
            expected = row_range(global_shape, dp_size, dp_rank)
            if len(global_shape) and local.shape[0] != expected[1] - expected[0]:
                raise ValueError(f"DTensor rows {tuple(local.shape)} do not match this rank's {expected} rows of "
                                 f"{tuple(global_shape)}; build the target state dict on the loading model")
            return local
    if tuple(value.shape) != tuple(global_shape):
        raise ValueError(f"checkpoint tensor of shape {tuple(value.shape)} does not match parameter shape "
                         f"{tuple(global_shape)}")
    if len(global_shape) == 0:
        return value
    start, end = chunk_rows(global_shape[0], dp_size, dp_rank)
    return value[start:end]


# ---- DTensors whose local blocks are not DTensor's own chunks ------------------------------------------------
# `split_dtensor` cuts a sharded DTensor into pieces along a dim: each rank's piece is the part of its block
# inside the piece, so pieces are generally uneven (not how `Shard` would cut them). Each piece remembers where
# its block starts (`_uneven_global_offset`); `uneven_dtensor_to_full_tensor` assembles any such DTensor, and
# pieces made with `update_uneven_dtensor_chunk_meta=True` also describe their block to
# torch.distributed.checkpoint, so they save and load like any DTensor.

def _require_dtensor(function: str, dtensor) -> DTensor:
    if not isinstance(dtensor, DTensor):
        shape = f" of shape {tuple(dtensor.shape)}" if isinstance(dtensor, torch.Tensor) else ""
        raise ValueError(f"{function}(): 'dtensor' must be a torch.distributed.tensor.DTensor, got a "
                         f"{type(dtensor).__module__}.{type(dtensor).__qualname__}{shape}; wrap this rank's "
                         "shard with DTensor.from_local(...) or pass a DTensor from a state dict")
    return dtensor


def local_block_offset(dtensor: DTensor) -> Tuple[int, ...]:
    """Global index of the first element of this rank's block of `dtensor` (for an empty block, where torch's
    `Shard` would place it: the end of the dim when no rows are left for this rank)."""
    _require_dtensor("local_block_offset", dtensor)
    offset = getattr(dtensor, "_uneven_global_offset", None)
    if offset is not None:
        return tuple(offset)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(dtensor.shape, dtensor.device_mesh, dtensor.placements)
    return tuple(offset)


def _section_bounds(length: int, split_size_or_sections) -> list:
    if isinstance(split_size_or_sections, int):
        if split_size_or_sections <= 0:
            raise ValueError(f"split_dtensor: split size must be positive, got {split_size_or_sections}")
        sizes = [min(split_size_or_sections, length - start) for start in range(0, length, split_size_or_sections)]
    else:
        sizes = list(split_size_or_sections)
        if sum(sizes) != length:
            raise ValueError(f"split_dtensor: sections {sizes} sum to {sum(sizes)}, not the dim's length {length}")
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def _describe_block_to_dcp(piece: DTensor):
    """Let torch.distributed.checkpoint write and read this rank's block of an uneven DTensor where it lies."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    def chunk():
        return ChunkStorageMetadata(offsets=torch.Size(piece._uneven_global_offset), sizes=piece.to_local().shape)

    def create_write_items(fqn, _object):
        return [WriteItem(index=MetadataIndex(fqn, chunk().offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk(),
                                                      properties=TensorProperties.create_from_tensor(piece.to_local()),
                                                      size=piece.size()))]

    piece.__create_write_items__ = create_write_items
    piece.__create_chunk_list__ = lambda: [chunk()]
    piece.__get_tensor_shard__ = lambda index: piece.to_local()


def split_dtensor(dtensor: DTensor, split_size_or_sections, dim: int = 0,
                  update_uneven_dtensor_chunk_meta: bool = False) -> list:
    """`torch.split` for a DTensor: pieces along `dim` (a size, or a list of sizes), each a DTensor on the same
    mesh and placements whose local part is a view of the part of this rank's block inside the piece. A rank
    whose block is empty (fewer rows than ranks), or that owns nothing of a piece, gets an empty local part
    placed at the piece's edge nearest its block."""
    _require_dtensor("split_dtensor", dtensor)
    dim = dim % dtensor.dim()
    local = dtensor.to_local()
    offset = local_block_offset(dtensor)
    block_start, block_end = offset[dim], offset[dim] + local.shape[dim]
    pieces = []
    for start, end in _section_bounds(dtensor.shape[dim], split_size_or_sections):
        low, high = max(start, block_start), min(end, block_end)
        if high < low:  # no overlap: an empty block at the edge of the piece nearest this rank's block
            low = high = min(max(block_start, start), end)
        local_piece = local.narrow(dim, min(max(low - block_start, 0), local.shape[dim]), high - low)
        shape = list(dtensor.shape)
        shape[dim] = end - start
        piece = dtensor_over_view(local_piece, dtensor.device_mesh, dtensor.placements, shape,
                                  contiguous_stride(shape))
        piece_offset = list(offset)
        piece_offset[dim] = low - start
        piece._uneven_global_offset = tuple(piece_offset)
        if update_uneven_dtensor_chunk_meta:
            _describe_block_to_dcp(piece)
        pieces.append(piece)
    return pieces


def uneven_dtensor_to_full_tensor(dtensor: DTensor, target_device: Optional[torch.device] = None) -> torch.Tensor:
    """The full tensor of a DTensor whose local blocks may be uneven (as `split_dtensor` makes them): every
    rank's block is gathered along each mesh dim and put at its offset (empty blocks add nothing). Call on
    every rank of the mesh."""
    import torch.distributed as dist

    _require_dtensor("uneven_dtensor_to_full_tensor", dtensor)
    blocks = [(local_block_offset(dtensor), dtensor.to_local().detach().cpu())]
    mesh = dtensor.device_mesh
    for mesh_dim in range(mesh.ndim):
        if isinstance(dtensor.placements[mesh_dim], Replicate):
            continue
        gathered = [None] * mesh.size(mesh_dim)
        dist.all_gather_object(gathered, blocks, group=mesh.get_group(mesh_dim))
        blocks = [block for rank_blocks in gathered for block in rank_blocks]
    full = torch.zeros(dtensor.shape, dtype=dtensor.dtype)
    for offset, block in blocks:
        if block.numel():
            full[tuple(slice(o, o + s) for o, s in zip(offset, block.shape))] = block
    return full.to(target_device if target_device is not None else dtensor.to_local().device)


def gather_uneven_dtensor_to_full_tensor(dtensor: DTensor,
                                         target_device: Optional[torch.device] = None) -> torch.Tensor:
    """Upstream's name for `uneven_dtensor_to_full_tensor`."""
    _require_dtensor("gather_uneven_dtensor_to_full_tensor", dtensor)
    return uneven_dtensor_to_full_tensor(dtensor, target_device)

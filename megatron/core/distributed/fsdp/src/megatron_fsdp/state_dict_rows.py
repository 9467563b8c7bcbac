"""A parameter group's per-parameter rows, the unit of Megatron-FSDP's state dicts (see state_dict.py).

Conversions between a group's flat storage and this rank's rows of each parameter: from the compute weights
(`_weight_rows`), from optimizer-level pieces (`_rows_of_pieces`, all-gathered over the outer group under HFSDP),
from checkpoint values back into a shard (`_shard_from_rows`, `_main_level`), and rows to the row-sharded DTensors
of the full (TP-unpartitioned) shape that state dicts hold (`_row_dtensors`). 0-dim parameters live on data-parallel
rank 0 only (`_replicate_scalars` hands their value to every rank).
"""

from typing import List, Optional

import torch
from torch.distributed.tensor import DTensor

from . import collectives
from .distributed_data_parallel_config import ShardingStrategy
from .param_and_grad_buffer import ParamGroup
from .resharding import copy_gathered_to_unsharded
from .uneven_dtensor import (
    local_rows_of,
    make_row_sharded_dtensor,
    tensor_parallel_full_shape,
    tensor_parallel_partition_of,
)

# The child name torch's `checkpoint_wrapper` gives the module it wraps; torch leaves it out of state-dict keys
# (the wrapper's state-dict hooks strip it, and torch.distributed.checkpoint's FQNs drop it), so ours do too.
CHECKPOINT_WRAPPER_PREFIX = "_checkpoint_wrapped_module."


def state_dict_name(name: str) -> str:
    """The state-dict key of a parameter or buffer named `name` by `named_parameters()` / `named_buffers()`."""
    return name.replace(CHECKPOINT_WRAPPER_PREFIX, "")


def _tp_partition_dim(group: ParamGroup, param):
    """The dim along which `param` holds its tensor-parallel partition, or None if it is replicated over its
    group's TP ranks (Megatron-Core's TP layers mark partitioned parameters, also at size 1; read with getattr to
    stay free of megatron.core). An expert group's TP size is the expert tensor-parallel size, not the model's."""
    if group.topology.tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return None
    return getattr(param, "partition_dim") % param.dim()


def _check_checkpointable(model):
    for group in model.groups:
        for name, param in zip(group.names, group.params):
            if _tp_partition_dim(group, param) is not None and getattr(param, "partition_stride", 1) != 1:
                raise NotImplementedError(
                    f"parameter '{name}' has partition_stride={param.partition_stride}: strided tensor-parallel "
                    "partitions have no DTensor placement here; build the layer with stride=1 to checkpoint it")


def _tensor_parallel_local_values(model, group: ParamGroup, values) -> list:
    """Checkpoint values of the full (TP-unpartitioned) shape -> values of this rank's TP partitions (zeros for
    a missing value, None)."""
    topology = group.topology
    return [torch.zeros(span.shape) if value is None else
            tensor_parallel_partition_of(value, span.shape, _tp_partition_dim(group, param), topology.tp_size,
                                         topology.tp_rank, topology.dp_size, topology.dp_rank)
            for value, span, param in zip(values, group.layout.spans, group.params)]


def _in_outer_sub_shards(group: ParamGroup) -> bool:
    """Whether a trainable group's main weights, optimizer gradients and state are HFSDP sub-shards. Pieces
    and loaded values of groups with main weights are at that level; those of frozen groups are compute shards."""
    return group.outer_sharded and group.main_weights is not None


def _shard_of_pieces(model, group: ParamGroup, pieces: List[torch.Tensor]) -> torch.Tensor:
    """This rank's whole shard from per-parameter main-level pieces (its rows, or under HFSDP the part of them
    in this outer rank's sub-shard, all-gathered over the outer group)."""
    layout = group.layout
    dtype = pieces[0].dtype if pieces else group.main_dtype
    sub_shards = _in_outer_sub_shards(group)
    local = torch.zeros(layout.sub_shard_numel if sub_shards else layout.shard_numel, dtype=dtype,
                        device=group.device)
    for piece_range, piece in zip(group.main_pieces if sub_shards else group.pieces, pieces):
        local[piece_range.shard_start:piece_range.shard_end].copy_(piece.reshape(-1))
    if not sub_shards:
        return local
    shard = torch.empty(layout.shard_numel, dtype=dtype, device=group.device)
    collectives.all_gather_flat(shard, local, group.topology.outer_group, collectives.CommunicationCounter())
    return shard


def _unsharded_of_shard(model, group: ParamGroup, shard: torch.Tensor) -> torch.Tensor:
    """The full group in its unsharded (param-major) form from every rank's shard (one all-gather)."""
    layout = group.layout
    gathered = torch.empty(layout.padded_numel, dtype=shard.dtype, device=shard.device)
    collectives.all_gather_flat(gathered, shard, group.topology.dp_group, collectives.CommunicationCounter())
    unsharded = torch.zeros_like(gathered)
    copy_gathered_to_unsharded(layout, gathered, unsharded)
    return unsharded


def _full_flat(model, group: ParamGroup, pieces: List[torch.Tensor]) -> torch.Tensor:
    """The full group in its unsharded form (`group.layout.spans` index it) from per-parameter local pieces
    (main-level pieces as the optimizer sees them, or whole parameters for no_shard). Collective."""
    if model.strategy == ShardingStrategy.no_shard:
        full = torch.zeros(group.layout.padded_numel, dtype=pieces[0].dtype if pieces else group.main_dtype,
                           device=group.device)
        for span, piece in zip(group.layout.spans, pieces):
            full[span.flat_start:span.flat_end].copy_(piece.reshape(-1))
        return full
    return _unsharded_of_shard(model, group, _shard_of_pieces(model, group, pieces))


def _rows_of_full(group: ParamGroup, fulls: List[torch.Tensor]) -> List[torch.Tensor]:
    """Per parameter, this rank's rows (views) of its full value."""
    return [full[slice(*group.row_range(index))] if group.layout.shapes[index]
            else full.reshape(()) for index, full in enumerate(fulls)]


def _rows_of_pieces(model, group: ParamGroup, pieces: List[torch.Tensor]) -> List[torch.Tensor]:
    """Per parameter, this rank's rows from the optimizer-level pieces (views where the pieces are this rank's
    rows already: everywhere but under HFSDP)."""
    if model.strategy == ShardingStrategy.no_shard:
        return _rows_of_full(group, pieces)
    if _in_outer_sub_shards(group):
        shard = _shard_of_pieces(model, group, pieces)
        return [group.rows_of_shard(shard, index) for index in range(len(pieces))]
    rows = []
    for index, piece in enumerate(pieces):
        if group.layout.shapes[index]:
            rows.append(piece.view(group.layout.local_shape(index, group.dp_rank)))
        else:  # rank 0 holds a 0-dim parameter; the others contribute zeros to the sum
            rows.append(piece.reshape(()) if piece.numel() else torch.zeros((), dtype=piece.dtype,
                                                                               device=piece.device))
    return rows


def _scalar_indices(group: ParamGroup) -> List[int]:
    return [index for index, shape in enumerate(group.layout.shapes) if not shape]


def _replicate_scalars(model, group: ParamGroup, rows: List[torch.Tensor],
                       known: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """0-dim values held by data-parallel rank 0 only -> the value on every rank: `known` (the values, in
    `_scalar_indices` order, where every rank has them without communication), else one sum over the group.
    Rank 0 keeps its row as it is (a view where `rows` are views, so a write into the state dict reaches it)."""
    if model.strategy == ShardingStrategy.no_shard:
        return rows
    scalars = _scalar_indices(group)
    if not scalars:
        return rows
    values = known
    if values is None:
        values = torch.stack([rows[index].detach().to(torch.float64) for index in scalars])
        if group.dp_rank != 0:
            values.zero_()
        collectives.all_reduce_scalar_sum(values, group.topology.dp_group)
    rows = list(rows)
    for position, index in enumerate(scalars):
        if group.dp_rank != 0:  # rank 0's own value stays: a view, so a write into the state dict reaches it
            rows[index] = values[position] if values.dtype == rows[index].dtype else values[position].to(
                rows[index].dtype)
    return rows


def _row_dtensors(model, group: ParamGroup, rows: List[torch.Tensor], copy: bool = False,
                  known_scalars: Optional[torch.Tensor] = None, full_weights: bool = False) -> List[DTensor]:
    """One DTensor of the full (TP-unpartitioned) shape per parameter, holding this rank's `rows` of its
    (partition of the) parameter (views of them, or copies with `copy`). `known_scalars`: see `_replicate_scalars`;
    `full_weights`: `rows` are of the full weights every rank holds (`_weight_rows` of strategies 0-2), 0-dim
    values included."""
    mesh, dp_mesh_dim, tp_mesh_dim = group.topology.checkpoint_mesh()
    if not full_weights:
        rows = _replicate_scalars(model, group, rows, known_scalars)
    result = []
    for index, (span, param) in enumerate(zip(group.layout.spans, group.params)):
        local = rows[index].detach()
        if copy:
            local = local.clone()
        partition_dim = _tp_partition_dim(group, param)
        shape = tensor_parallel_full_shape(span.shape, partition_dim, group.topology.tp_size)
        result.append(make_row_sharded_dtensor(local, shape, mesh, dp_mesh_dim, tp_mesh_dim, partition_dim))
    return result


def _weight_rows(model, group: ParamGroup) -> List[torch.Tensor]:
    """This rank's rows of every parameter in the compute dtype, as views of the weights the module computes
    with (the compute shard, or the full compute buffer of strategies 0-2 through `state_dict_alias`)."""
    if group.shards_params:
        return [group.rows_of_shard(group.compute_shard, index) for index in range(len(group.params))]
    if group.state_dict_alias is None:
        group.state_dict_alias = group.compute_buffer.data  # see GroupWeights.state_dict_alias
        group.state_dict_alias_version = group.state_dict_alias._version
    alias = group.state_dict_alias
    return _rows_of_full(group, [alias[span.flat_start:span.flat_end].view(span.shape) for span in group.layout.spans])


def _shard_from_rows(model, group: ParamGroup, values: List[torch.Tensor], dtype) -> torch.Tensor:
    """This rank's rows of every parameter (from checkpoint values) -> this rank's whole shard, padding zeroed.
    No communication, except under no_shard, whose "shard" is the full group: every rank writes its rows into
    zeros and the sum over the data-parallel group assembles it."""
    topology = group.topology
    if model.strategy == ShardingStrategy.no_shard:
        full = torch.zeros(group.layout.padded_numel, dtype=dtype, device=group.device)
        for index, (span, value) in enumerate(zip(group.layout.spans, values)):
            rows = local_rows_of(value, span.shape, topology.dp_size, topology.dp_rank)
            start, end = group.row_range(index)
            if not span.shape:
                start, end = (0, 1) if group.dp_rank == 0 else (0, 0)
            row_numel = group.layout.chunks[index].row_numel
            full[span.flat_start + start * row_numel:span.flat_start + end * row_numel].copy_(
                rows.reshape(-1)[:(end - start) * row_numel])
        collectives.all_reduce_scalar_sum(full, topology.dp_group)
        return full
    shard = torch.zeros(group.layout.shard_numel, dtype=dtype, device=group.device)
    for span, value, piece in zip(group.layout.spans, values, group.pieces):
        if piece.numel:
            rows = local_rows_of(value, span.shape, topology.dp_size, topology.dp_rank)
            shard[piece.shard_start:piece.shard_end].copy_(rows.reshape(-1))
    return shard


def _main_level(model, group: ParamGroup, shard: torch.Tensor) -> torch.Tensor:
    """A whole shard -> what the main weights (and the optimizer's state) hold: the HFSDP sub-shard, or the
    shard itself (for no_shard the full group)."""
    if _in_outer_sub_shards(group):
        return shard[group.sub_shard_slice]
    return shard


"""Newton-Schulz shared out over data parallel: which rank orthogonalizes which Muon matrix, and the exchanges
that bring each matrix to that rank and the result back to the ranks that need it.

Every data-parallel rank needs the Muon update of every matrix it holds, but the update is the same function of
the same whole matrix everywhere, so one rank (the matrix's *owner*) can compute it for all. The matrices of a
param group that lie alike over the same process groups form a *bucket*, laid out over two kinds of groups
(a `Placement`):
- *piece groups*: the ranks of these groups (taken together, a grid) hold disjoint flat pieces of the flattened
  matrix that make it up (the distributed optimizer and Megatron-FSDP mark them with a `MatrixPiece`: one group,
  or the shard and outer groups under HFSDP; FSDP2 shards DTensors by rows over one mesh dimension);
- *replica groups*: the ranks of these hold the same thing (the whole matrix under Megatron DDP, over the
  data-parallel group with context parallel, the expert data-parallel group for experts; the same rows under
  FSDP2's HSDP, over the replicating mesh dimension).
Owners are spread over all ranks of the bucket (piece and replica groups together). An owner gathers its matrix
from the pieces at its replica coordinate: one all-to-all per piece group, the last group first, each sending the
pieces gathered so far one step closer to the owner; it orthogonalizes the whole, and the same all-to-alls in
reverse hand each rank its piece of the result. One all-gather per replica group (padded to the largest share)
then hands the results to the ranks at the other replica coordinates. Pieces cross each piece group twice,
fewer bytes than the all-reduce of every whole matrix that assembling it everywhere takes; where ranks held
whole matrices (DDP) the all-gather moves as many bytes as the results, where they exchanged none before.
Owners are chosen by the Newton-Schulz cost of each matrix (largest first, each to the least loaded rank, loads
carried over the param groups of a step), the same on every rank. An owner computes what every rank would (the
same fp32 ops on the same whole matrix); pieces are copied, never summed, so the results are bit-equal to
orthogonalizing on every rank.
"""

import itertools
import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core.distributed.data_parallel_base import is_dtensor
from megatron.core.expert_parameters import is_expert_parameter


class Placement(NamedTuple):
    """How one Muon update lies over data parallel: disjoint pieces over the grid of `pieces` (groups), each
    piece held alike by the ranks of `replicas` (groups). Groups of one rank are left out."""

    pieces: tuple
    replicas: tuple

    @property
    def world_size(self) -> int:
        return math.prod(dist.get_world_size(group) for group in self.pieces + self.replicas)


def newton_schulz_cost(rows, cols, qkv_split=None):
    """Multiply-adds of one Newton-Schulz iteration on a `rows` x `cols` matrix (each of Q, K and V apart with
    `qkv_split`): X X^T, A A and (b A + c A^2) X on the orientation with fewer rows."""
    if qkv_split:
        per_group = sum(qkv_split)
        return sum(newton_schulz_cost(rows // per_group * size, cols) for size in qkv_split)
    short, long = min(rows, cols), max(rows, cols)
    return 2 * short * short * long + short ** 3


def assign_owners(costs: Sequence[float], world_size: int, loads: Optional[List[float]] = None) -> List[int]:
    """The owning rank of each matrix: largest cost first, each to the least loaded rank (the lower on ties).
    `loads`: each rank's cost so far (of earlier param groups), updated in place; zeros when None."""
    loads = [0] * world_size if loads is None else loads
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda index: (-costs[index], index)):
        owner = min(range(world_size), key=lambda rank: (loads[rank], rank))
        owners[index] = owner
        loads[owner] += costs[index]
    return owners


def _replicated_group(param):
    """The group over which a whole (unsharded) matrix is replicated, or None outside Megatron's data parallel."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    if is_expert_parameter(param):
        return parallel_state.get_expert_data_parallel_group()
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def _mesh_placement(update) -> Optional[Placement]:
    """Rows of a DTensor over one mesh dimension, replicated over the others (FSDP2, HSDP included); None for
    any other sharding."""
    from torch.distributed.tensor import Shard

    sharded = [dim for dim, placement in enumerate(update.placements) if not placement.is_replicate()]
    if len(sharded) != 1 or type(update.placements[sharded[0]]) is not Shard or update.placements[sharded[0]].dim:
        return None
    mesh = update.device_mesh
    return Placement((mesh.get_group(sharded[0]),),
                     tuple(mesh.get_group(dim) for dim in range(mesh.ndim) if dim != sharded[0]))


def placement_of(param, update) -> Optional[Placement]:
    """The placement of `param`'s update over data parallel, or None where Newton-Schulz stays on every rank (a
    single rank; a DTensor sharded otherwise than by rows over one mesh dimension, see `unshared_layout`)."""
    piece = getattr(param, "matrix_piece", None)
    if piece is not None:
        placement = Placement(tuple(piece.groups), tuple(piece.replica_groups))
    elif is_dtensor(update):
        placement = _mesh_placement(update)
    else:
        group = _replicated_group(param)
        placement = None if group is None else Placement((), (group,))
    if placement is None:
        return None
    placement = Placement(*(tuple(group for group in groups if dist.get_world_size(group) > 1)
                            for groups in placement))
    return placement if placement.world_size > 1 else None


def unshared_layout(param) -> Optional[str]:
    """A description of `param`'s layout where it spans several ranks but its Newton-Schulz is not shared (each
    of those ranks assembles and orthogonalizes the whole matrix); None otherwise."""
    if not is_dtensor(param) or param.device_mesh.size() == 1:
        return None
    if _mesh_placement(param) is not None:
        return None
    return (f"a DTensor on a {param.device_mesh.ndim}-D mesh {tuple(param.device_mesh.mesh.shape)} with placements "
            f"{tuple(param.placements)}")


def flat_piece(param, update):
    """(this rank's elements of the flattened matrix as a flat fp32 tensor, the matrix's shape)."""
    piece = getattr(param, "matrix_piece", None)
    if piece is not None:
        return update.reshape(-1).float(), piece.shape
    if is_dtensor(update):
        return update.to_local().reshape(-1).float(), tuple(update.shape)
    return update.reshape(-1).float(), tuple(update.shape)


def piece_range(param, update):
    """(start, end) of this rank's piece in the flattened matrix; (-1, length) for a row shard of a DTensor,
    whose start follows from the lengths of the lower ranks'."""
    piece = getattr(param, "matrix_piece", None)
    if piece is not None:
        return piece.start, piece.end
    if is_dtensor(update):
        return -1, update.to_local().numel()
    return 0, update.numel()


class PieceTable:
    """Every rank's piece of each matrix of a bucket, by the rank's coordinate in the grid of the piece groups
    (its rank in each, first group first): `ranges[coordinate][matrix] -> (start, end)`. `held_length(prefix,
    matrix)`: the elements of the pieces of all ranks whose coordinate starts with `prefix`."""

    def __init__(self, ranges: Dict[tuple, List[Tuple[int, int]]], sizes: Sequence[int], coordinate: tuple):
        self.ranges, self.sizes, self.coordinate = ranges, tuple(sizes), coordinate
        self._held: Dict[tuple, List[int]] = {}
        for rank_coordinate, rank_ranges in ranges.items():
            lengths = [end - start for start, end in rank_ranges]
            for depth in range(len(rank_coordinate) + 1):
                totals = self._held.setdefault(rank_coordinate[:depth], [0] * len(lengths))
                for matrix, length in enumerate(lengths):
                    totals[matrix] += length

    def held_length(self, prefix, matrix) -> int:
        return self._held[tuple(prefix)][matrix]

    def coordinates(self):
        """Every rank's coordinate, in the order of the pieces in a gathered matrix."""
        return itertools.product(*(range(size) for size in self.sizes))


def gather_piece_table(ranges: Sequence[Tuple[int, int]], groups: Sequence, device) -> PieceTable:
    """The `PieceTable` of a bucket over the piece `groups` from each rank's `ranges` (see `piece_range`): one
    all-gather per group, each of what the previous ones gathered. The groups must form a grid (as the
    dimensions of a device mesh do): checked against their members."""
    local = torch.tensor([[start, end, dist.get_rank()] for start, end in ranges], dtype=torch.int64,
                         device=device).reshape(-1, 3)
    gathered = local
    for group in groups:
        parts = [torch.empty_like(gathered) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, gathered.contiguous(), group=group)
        gathered = torch.stack(parts)  # [rank in this group, ..., rank in the first group, matrix, 3]
    sizes = tuple(dist.get_world_size(group) for group in groups)
    coordinate = tuple(dist.get_rank(group) for group in groups)
    table = gathered.tolist()
    ranges_by_rank, offsets = {}, [0] * len(ranges)
    for rank_coordinate in itertools.product(*(range(size) for size in sizes)):
        entry = table
        for position in reversed(rank_coordinate):
            entry = entry[position]
        for level, group in enumerate(groups):
            if rank_coordinate[:level] + rank_coordinate[level + 1:] == coordinate[:level] + coordinate[level + 1:]:
                expected = dist.get_process_group_ranks(group)[rank_coordinate[level]]
                if entry and entry[0][2] != expected:
                    raise ValueError(f"Muon's piece groups (sizes {sizes}) do not form a grid: rank {expected} "
                                     f"stands at {rank_coordinate}, rank {entry[0][2]} answered")
        rank_ranges = []
        for matrix, (start, end, _) in enumerate(entry):
            if start == -1:  # rows of a DTensor: the ranks' pieces follow each other in rank order
                start, end = offsets[matrix], offsets[matrix] + end
            offsets[matrix] = end
            rank_ranges.append((start, end))
        ranges_by_rank[rank_coordinate] = rank_ranges
    return PieceTable(ranges_by_rank, sizes, coordinate)


def _concat(tensors, device):
    return torch.cat(tensors) if tensors else torch.empty(0, dtype=torch.float32, device=device)


def _exchange(held: Dict[int, torch.Tensor], outgoing, incoming, group, device):
    """One all-to-all over `group`: `outgoing[rank]` lists (matrix, slice of `held[matrix]`) to send to `rank`,
    `incoming[rank]` lists (matrix, elements) to receive from it; returns {matrix: received pieces joined in
    rank order}."""
    send = [held[matrix][part] for parts in outgoing for matrix, part in parts]
    send_sizes = [sum(tensor.numel() for tensor in send_to) for send_to in
                  ([held[matrix][part] for matrix, part in parts] for parts in outgoing)]
    receive_sizes = [sum(length for _, length in parts) for parts in incoming]
    received = torch.empty(sum(receive_sizes), dtype=torch.float32, device=device)
    dist.all_to_all_single(received, _concat(send, device), receive_sizes, send_sizes, group=group)
    joined: Dict[int, List[torch.Tensor]] = {}
    offset = 0
    for parts in incoming:
        for matrix, length in parts:
            joined.setdefault(matrix, []).append(received[offset:offset + length])
            offset += length
    return {matrix: torch.cat(tensors) for matrix, tensors in joined.items()}


def _orthogonalize_pieces(pieces, shapes, table: PieceTable, owners, groups, matrices, orthogonalize):
    """This rank's flat pieces of `orthogonalize(matrix, whole matrix)` for `matrices` (indices), pieced over
    the grid of `groups`; `owners[matrix]`: the owner's coordinate in that grid.

    Before the all-to-all over group `level` (the last group first) a rank holds, for each matrix whose owner
    agrees with it on the later groups, the pieces of all ranks agreeing with it on the groups up to `level`,
    joined in coordinate order; it sends them to the rank of that group at the owner's coordinate. The way back
    cuts what a rank holds into the contiguous parts of each rank of the group, in the same order."""
    me, device = table.coordinate, pieces[0].device
    held = {matrix: pieces[matrix] for matrix in matrices}

    def agreeing(level):  # the matrices whose owner agrees with this rank on groups `level`, `level` + 1, ...
        return [matrix for matrix in matrices if tuple(owners[matrix][level:]) == me[level:]]

    for level in reversed(range(len(groups))):
        sources = agreeing(level + 1)
        outgoing = [[(matrix, slice(None)) for matrix in sources if owners[matrix][level] == rank]
                    for rank in range(table.sizes[level])]
        incoming = [[(matrix, table.held_length(me[:level] + (rank,), matrix)) for matrix in agreeing(level)]
                    for rank in range(table.sizes[level])]
        held = _exchange(held, outgoing, incoming, groups[level], device)
    results = {}
    for matrix in agreeing(0):
        whole = torch.zeros(math.prod(shapes[matrix]), dtype=torch.float32, device=device)
        offset = 0
        for coordinate in table.coordinates():
            start, end = table.ranges[coordinate][matrix]
            whole[start:end] = held[matrix][offset:offset + end - start]
            offset += end - start
        result = orthogonalize(matrix, whole.view(shapes[matrix])).reshape(-1)
        results[matrix] = torch.cat([result[slice(*table.ranges[coordinate][matrix])]
                                     for coordinate in table.coordinates()])
    for level in range(len(groups)):
        outgoing, offsets = [], {matrix: 0 for matrix in agreeing(level)}
        for rank in range(table.sizes[level]):
            parts = []
            for matrix in agreeing(level):
                length = table.held_length(me[:level] + (rank,), matrix)
                parts.append((matrix, slice(offsets[matrix], offsets[matrix] + length)))
                offsets[matrix] += length
            outgoing.append(parts)
        incoming = [[(matrix, table.held_length(me[:level + 1], matrix)) for matrix in agreeing(level + 1)
                     if owners[matrix][level] == rank] for rank in range(table.sizes[level])]
        results = _exchange(results, outgoing, incoming, groups[level], device)
    return results


def orthogonalize_bucket(pieces: Sequence[torch.Tensor], shapes, table: PieceTable, owners, placement: Placement,
                         orthogonalize) -> List[torch.Tensor]:
    """This rank's flat pieces of `orthogonalize(matrix index, whole matrix)` for each matrix of a bucket.
    `pieces[i]`: this rank's flat fp32 piece of matrix i (the whole of it without piece groups); `table`: the
    bucket's `PieceTable` over `placement.pieces`; `owners[i]`: the owner's rank among `placement.world_size`
    (replica groups, then piece groups, the first the slowest)."""
    groups = placement.replicas + placement.pieces
    coordinates = [coordinate for coordinate in itertools.product(*(range(dist.get_world_size(group))
                                                                     for group in groups))]
    owners = [coordinates[owner] for owner in owners]
    replica_count = len(placement.replicas)
    mine = tuple(dist.get_rank(group) for group in placement.replicas)
    here = [matrix for matrix, owner in enumerate(owners) if owner[:replica_count] == mine]
    results = _orthogonalize_pieces(pieces, shapes, table, [owner[replica_count:] for owner in owners],
                                    placement.pieces, here, orthogonalize)
    device = pieces[0].device
    for level in reversed(range(replica_count)):
        group = placement.replicas[level]
        by_rank = [[matrix for matrix, owner in enumerate(owners)
                    if owner[:level] == mine[:level] and owner[level] == rank]
                   for rank in range(dist.get_world_size(group))]
        sizes = [sum(pieces[matrix].numel() for matrix in matrices) for matrices in by_rank]
        local = torch.zeros(max(sizes), dtype=torch.float32, device=device)
        if by_rank[mine[level]]:
            local[:sizes[mine[level]]] = torch.cat([results[matrix] for matrix in by_rank[mine[level]]])
        gathered = [torch.empty_like(local) for _ in by_rank]
        dist.all_gather(gathered, local, group=group)
        for matrices, share in zip(by_rank, gathered):
            offset = 0
            for matrix in matrices:
                results[matrix] = share[offset:offset + pieces[matrix].numel()]
                offset += pieces[matrix].numel()
    return [results[matrix] for matrix in range(len(pieces))]

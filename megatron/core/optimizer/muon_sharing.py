"""Newton-Schulz shared out over data parallel: which rank orthogonalizes which Muon matrix, and the exchanges
that bring each matrix to that rank and the result back to the ranks that need it.

Every data-parallel rank needs the Muon update of every matrix it holds, but the update is the same function of
the same whole matrix everywhere, so one rank (the matrix's *owner*) can compute it for all. The matrices of a
param group that lie alike over one process group form a *bucket*, laid out one of two ways:
- `replicated`: every rank holds the whole matrix (Megatron DDP; the group is the data-parallel group, with
  context parallel, or the expert data-parallel group for experts). Owners orthogonalize their matrices and one
  all-gather hands every rank every result: as many bytes as the results, where the ranks exchanged none before.
- `pieces`: each rank holds a flat piece of the flattened matrix (the distributed optimizer and Megatron-FSDP
  mark them with a `MatrixPiece` over one group; FSDP2 shards DTensors by rows over a 1-D mesh). One all-to-all
  sends every piece to its matrix's owner, which assembles and orthogonalizes it, and a second one sends each
  rank its piece of the result: each rank sends and receives about its pieces twice, less than the all-reduce
  of every whole matrix that assembling it everywhere takes.
Owners are chosen by the Newton-Schulz cost of each matrix (largest first, each to the least loaded rank, loads
carried over the param groups of a step), the same on every rank. An owner computes what every rank would (the
same fp32 ops on the same whole matrix); pieces are copied, never summed, so the results are bit-equal to
orthogonalizing on every rank.
"""

import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core.expert_parameters import is_expert_parameter

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # torch built without distributed
    DTensor = Shard = None


class Placement(NamedTuple):
    """How one Muon update lies over a process group: `kind` is "replicated" or "pieces"."""

    kind: str
    group: object


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


def placement_of(param, update) -> Optional[Placement]:
    """The placement of `param`'s update over data parallel, or None where Newton-Schulz stays on every rank
    (a single rank; a matrix pieced over several groups; a DTensor on a mesh of more than one dimension)."""
    piece = getattr(param, "matrix_piece", None)
    if piece is not None:
        return Placement("pieces", piece.groups[0]) if len(piece.groups) == 1 else None
    if DTensor is not None and isinstance(update, DTensor):
        if update.device_mesh.ndim != 1 or tuple(update.placements) != (Shard(0),):
            return None
        group = update.device_mesh.get_group()
    else:
        group = _replicated_group(param)
    if group is None or dist.get_world_size(group) == 1:
        return None
    return Placement("pieces" if DTensor is not None and isinstance(update, DTensor) else "replicated", group)


def flat_piece(param, update):
    """(this rank's elements of the flattened matrix as a flat fp32 tensor, the matrix's shape)."""
    piece = getattr(param, "matrix_piece", None)
    if piece is not None:
        return update.reshape(-1).float(), piece.shape
    if DTensor is not None and isinstance(update, DTensor):
        return update.to_local().reshape(-1).float(), tuple(update.shape)
    return update.reshape(-1).float(), tuple(update.shape)


def piece_range(param, update):
    """(start, end) of this rank's piece in the flattened matrix; (-1, length) for a row shard of a DTensor,
    whose start follows from the lengths of the lower ranks'."""
    piece = getattr(param, "matrix_piece", None)
    if piece is not None:
        return piece.start, piece.end
    return -1, update.to_local().numel()


def as_update(update, flat):
    """`flat`, this rank's elements of an orthogonalized matrix, in the form of its piece `update`."""
    if DTensor is not None and isinstance(update, DTensor):
        local = flat.view(update.to_local().shape)
        return DTensor.from_local(local, update.device_mesh, update.placements, run_check=False,
                                  shape=update.shape, stride=update.stride())
    return flat.view_as(update)


def gather_piece_ranges(ranges: Sequence[Tuple[int, int]], group, device) -> List[List[Tuple[int, int]]]:
    """`[rank][matrix] -> (start, end)` over `group` from each rank's `ranges` (see `piece_range`)."""
    local = torch.tensor(list(ranges), dtype=torch.int64, device=device).reshape(-1, 2)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    table = [[tuple(pair) for pair in rank_ranges.tolist()] for rank_ranges in gathered]
    for matrix in range(len(ranges)):
        offset = 0
        for rank_ranges in table:
            start, length = rank_ranges[matrix]
            if start == -1:  # rows of a DTensor: the ranks' pieces follow each other in rank order
                rank_ranges[matrix] = (offset, offset + length)
            offset = rank_ranges[matrix][1]
    return table


def _concat(tensors, device):
    return torch.cat(tensors) if tensors else torch.empty(0, dtype=torch.float32, device=device)


def orthogonalize_pieces(pieces: Sequence[torch.Tensor], shapes, ranges, owners, group,
                         orthogonalize) -> List[torch.Tensor]:
    """This rank's flat pieces of `orthogonalize(matrix index, whole matrix)` for each matrix of a bucket.
    `pieces[i]`: this rank's flat fp32 piece of matrix i; `ranges[rank][i]`: (start, end) of rank's piece of it."""
    rank, world_size, device = dist.get_rank(group), dist.get_world_size(group), pieces[0].device
    by_owner = [[index for index, owner in enumerate(owners) if owner == destination]
                for destination in range(world_size)]
    mine = by_owner[rank]
    send_sizes = [sum(pieces[index].numel() for index in by_owner[destination]) for destination in range(world_size)]
    receive_sizes = [sum(ranges[source][index][1] - ranges[source][index][0] for index in mine)
                     for source in range(world_size)]
    received = torch.empty(sum(receive_sizes), dtype=torch.float32, device=device)
    dist.all_to_all_single(received, _concat([pieces[index] for owned in by_owner for index in owned], device),
                           receive_sizes, send_sizes, group=group)
    wholes = {index: torch.zeros(math.prod(shapes[index]), dtype=torch.float32, device=device) for index in mine}
    offset = 0
    for source in range(world_size):
        for index in mine:
            start, end = ranges[source][index]
            wholes[index][start:end] = received[offset:offset + end - start]
            offset += end - start
    results: Dict[int, torch.Tensor] = {
        index: orthogonalize(index, wholes[index].view(shapes[index])).reshape(-1) for index in mine}
    returned = torch.empty(sum(send_sizes), dtype=torch.float32, device=device)
    dist.all_to_all_single(returned, _concat([results[index][slice(*ranges[source][index])]
                                              for source in range(world_size) for index in mine], device),
                           send_sizes, receive_sizes, group=group)
    own_pieces: List[Optional[torch.Tensor]] = [None] * len(pieces)
    offset = 0
    for owned in by_owner:
        for index in owned:
            own_pieces[index] = returned[offset:offset + pieces[index].numel()]
            offset += pieces[index].numel()
    return own_pieces


def orthogonalize_replicated(matrices: Sequence[torch.Tensor], owners, group, orthogonalize) -> List[torch.Tensor]:
    """`orthogonalize(matrix index, matrix)` of every matrix of a bucket whose ranks all hold the same whole
    matrices: each rank computes its own, one all-gather (padded to the largest share) hands them to all."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    by_owner = [[index for index, owner in enumerate(owners) if owner == destination]
                for destination in range(world_size)]
    sizes = [sum(matrices[index].numel() for index in owned) for owned in by_owner]
    local = torch.zeros(max(sizes), dtype=torch.float32, device=matrices[0].device)
    offset = 0
    for index in by_owner[rank]:
        size = matrices[index].numel()
        local[offset:offset + size] = orthogonalize(index, matrices[index]).reshape(-1)
        offset += size
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local, group=group)
    results: List[Optional[torch.Tensor]] = [None] * len(matrices)
    for owned, shares in zip(by_owner, gathered):
        offset = 0
        for index in owned:
            size = matrices[index].numel()
            results[index] = shares[offset:offset + size].view(matrices[index].shape)
            offset += size
    return results

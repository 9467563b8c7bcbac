"""What one rank's local checkpoint holds, as pieces: pure bookkeeping, no files and no torch.distributed.

The run's state is the flat dict the logical format builds (`{key: ShardedLogicalTensor | object}`, see
`megatron.training.checkpoint_state`). A *piece* is one box of a logical tensor that this rank holds, named by a
`PieceId` (key, offsets, shape, dtype): two ranks holding the same id hold replicas of the same elements (data-
or tensor-parallel copies), which training keeps equal.

`--non-persistent-local-ckpt-algo atomic` stores every piece a rank holds, so each rank's file alone restores
it. `fully_parallel` stores each replicated piece once, on the holder `assign_owners` picks (balancing bytes
over ranks); a load then receives the pieces it holds but did not store from their owners.
"""

import math
from typing import Dict, Iterable, List, NamedTuple, Tuple

import torch

from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor

DEFAULT_ALGORITHM = "fully_parallel"


class PieceId(NamedTuple):
    key: str
    offsets: Tuple[int, ...]
    shape: Tuple[int, ...]
    dtype: str  # e.g. "torch.float32"

    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_from_name(self.dtype).itemsize


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.split(".")[-1], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a local checkpoint")
    return dtype


def _as_logical(value):
    """A tensor value (plain or DTensor) as its locally held box(es); other values are objects."""
    if isinstance(value, ShardedLogicalTensor):
        return value
    if torch.is_tensor(value):
        return ShardedLogicalTensor.from_local(value)
    return None


def pieces_of(state: Dict[str, object]) -> Dict[PieceId, torch.Tensor]:
    """{piece id: the live local tensor} of every tensor in `state` (views, nothing copied)."""
    pieces = {}
    for key, value in state.items():
        logical = _as_logical(value)
        if logical is None:
            continue
        for offsets, tensor in logical.pieces:
            pieces[PieceId(key, tuple(int(o) for o in offsets), tuple(tensor.shape), str(tensor.dtype))] = tensor
    return pieces


def objects_of(state: Dict[str, object]) -> Dict[str, object]:
    """The values of `state` that are not tensors (scheduler, optimizer step and hyperparameters, RNG, ...)."""
    return {key: value for key, value in state.items() if _as_logical(value) is None}


def assign_owners(held_by_rank: List[Iterable[PieceId]]) -> Dict[PieceId, int]:
    """{piece id: the rank that stores it} for `fully_parallel`: a piece one rank holds is stored by that rank;
    a replicated piece by one of its holders, the largest pieces first, each to the holder with the fewest bytes
    so far (the lowest rank on a tie). Every rank computes the same answer from the same input."""
    holders: Dict[PieceId, List[int]] = {}
    for rank, held in enumerate(held_by_rank):
        for piece in held:
            holders.setdefault(piece, []).append(rank)
    load = [0] * len(held_by_rank)
    owners = {}
    for piece, ranks in holders.items():
        if len(ranks) == 1:
            owners[piece] = ranks[0]
            load[ranks[0]] += piece.nbytes()
    replicated = sorted((piece for piece, ranks in holders.items() if len(ranks) > 1),
                        key=lambda piece: (-piece.nbytes(), piece))
    for piece in replicated:
        owner = min(holders[piece], key=lambda rank: (load[rank], rank))
        owners[piece] = owner
        load[owner] += piece.nbytes()
    return owners


def exchange_plan(owners: Dict[PieceId, int], held_by_rank: List[Iterable[PieceId]]) -> List[Tuple[PieceId, int]]:
    """[(piece id, owner)] of the pieces some rank holds without storing them, in the order a load sends them:
    by owner, then by id (the same list on every rank)."""
    needed = set()
    for rank, held in enumerate(held_by_rank):
        needed.update(piece for piece in held if owners[piece] != rank)
    return sorted(((piece, owners[piece]) for piece in needed), key=lambda item: (item[1], item[0]))


def missing_pieces(targets: Dict[str, object], available: Iterable[PieceId]) -> List[PieceId]:
    """The pieces of the load targets that the local checkpoint cannot fill (another layout, model or dtype)."""
    available = set(available)
    return [piece for piece in pieces_of(targets) if piece not in available]


def fill(targets: Dict[str, object], saved: Dict[PieceId, torch.Tensor]):
    """Copy the saved pieces into the targets' live pieces, in place (every target piece must be in `saved`)."""
    for piece, tensor in pieces_of(targets).items():
        tensor.copy_(saved[piece])


def describe_missing(missing: List[PieceId], limit: int = 3) -> str:
    shown = ", ".join(f"{piece.key} {list(piece.shape)} at {list(piece.offsets)} ({piece.dtype})"
                      for piece in missing[:limit])
    more = f" and {len(missing) - limit} more" if len(missing) > limit else ""
    return f"it lacks {len(missing)} tensor piece(s) this rank holds: {shown}{more}"

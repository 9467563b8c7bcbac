"""Pure arithmetic of a flat parameter group: where each parameter lives and which rank owns which elements.

A group's parameters are laid end to end in one flat buffer, padded at the end so the flat size divides the
data-parallel size. Rank `r` owns the contiguous slice `[r * shard_numel, (r + 1) * shard_numel)`. A parameter
may straddle shard boundaries, so each rank owns a (possibly empty) contiguous piece of each parameter.

HFSDP shards the main weights a second time, over the `outer_size` ranks of the outer dim: the padding then
makes every shard split into `outer_size` equal sub-shards, and outer rank `o` of shard rank `r` owns
`[r * shard_numel + o * sub_shard_numel, ... + sub_shard_numel)`. With `outer_size=1` the sub-shard is the shard.
Nothing here touches torch.distributed; everything can be unit-tested without processes.
"""

import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple


@dataclass(frozen=True)
class ParamSpan:
    """Where one parameter sits in the flat buffer: elements `[flat_start, flat_end)`."""

    flat_start: int
    flat_end: int
    shape: Tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.flat_end - self.flat_start


@dataclass(frozen=True)
class LocalPiece:
    """The part of one parameter that a rank owns.

    `param_start:param_end` indexes the flattened parameter; `shard_start:shard_end` indexes the rank's shard.
    Both ranges have the same length, which may be zero.
    """

    param_start: int
    param_end: int
    shard_start: int
    shard_end: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


class GroupLayout:
    """Offsets, padding and ownership for the parameters of one group sharded over `dp_size` ranks (and each
    shard again over `outer_size` outer ranks, for HFSDP's main weights)."""

    def __init__(self, shapes: Sequence[Sequence[int]], dp_size: int, outer_size: int = 1):
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        if outer_size < 1:
            raise ValueError(f"outer_size must be >= 1, got {outer_size}")
        self.dp_size, self.outer_size = dp_size, outer_size
        spans, offset = [], 0
        for shape in shapes:
            numel = math.prod(shape)
            spans.append(ParamSpan(offset, offset + numel, tuple(shape)))
            offset += numel
        self.spans: List[ParamSpan] = spans
        self.numel = offset
        # At least one element per (sub-)shard, so every rank has something to communicate.
        self.sub_shard_numel = max(1, math.ceil(offset / (dp_size * outer_size)))
        self.shard_numel = self.sub_shard_numel * outer_size
        self.padded_numel = self.shard_numel * dp_size

    def shard_range(self, rank: int) -> Tuple[int, int]:
        """Flat elements `[start, end)` owned by `rank`."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def sub_shard_offset(self, outer_rank: int) -> int:
        """Where outer rank `outer_rank`'s sub-shard starts inside a shard."""
        return outer_rank * self.sub_shard_numel

    def sub_shard_range(self, rank: int, outer_rank: int) -> Tuple[int, int]:
        """Flat elements `[start, end)` owned by outer rank `outer_rank` within the shard of `rank`."""
        start = rank * self.shard_numel + self.sub_shard_offset(outer_rank)
        return start, start + self.sub_shard_numel

    def local_piece(self, param_index: int, rank: int) -> LocalPiece:
        """The piece of parameter `param_index` that `rank` owns (possibly empty)."""
        return self._piece_in_range(param_index, *self.shard_range(rank))

    def sub_shard_piece(self, param_index: int, rank: int, outer_rank: int) -> LocalPiece:
        """The piece of parameter `param_index` in the sub-shard of (`rank`, `outer_rank`); its
        `shard_start:shard_end` index that sub-shard."""
        return self._piece_in_range(param_index, *self.sub_shard_range(rank, outer_rank))

    def _piece_in_range(self, param_index: int, range_start: int, range_end: int) -> LocalPiece:
        span = self.spans[param_index]
        start, end = max(span.flat_start, range_start), min(span.flat_end, range_end)
        if end <= start:
            clamp = min(max(span.flat_start, range_start), range_end) - range_start
            return LocalPiece(0, 0, clamp, clamp)
        return LocalPiece(start - span.flat_start, end - span.flat_start, start - range_start, end - range_start)

    def local_pieces(self, rank: int) -> List[LocalPiece]:
        return [self.local_piece(index, rank) for index in range(len(self.spans))]

    def sub_shard_pieces(self, rank: int, outer_rank: int) -> List[LocalPiece]:
        return [self.sub_shard_piece(index, rank, outer_rank) for index in range(len(self.spans))]

    def owners_of_param(self, param_index: int) -> List[int]:
        """Ranks whose shard holds at least one element of the parameter."""
        return [rank for rank in range(self.dp_size) if self.local_piece(param_index, rank).numel > 0]


def chunk_rows(num_rows: int, world_size: int, rank: int) -> Tuple[int, int]:
    """Rows `[start, end)` that `rank` holds when `num_rows` rows are split like `torch.chunk` / DTensor Shard(0).

    Every rank but possibly the trailing ones gets `ceil(num_rows / world_size)` rows; trailing ranks may get
    fewer or none.
    """
    rows_per_rank = math.ceil(num_rows / world_size) if num_rows else 0
    start = min(rank * rows_per_rank, num_rows)
    return start, min(start + rows_per_rank, num_rows)


def bucket_by_size(numels: Sequence[int], max_bucket_numel: int) -> List[List[int]]:
    """Split indices into consecutive buckets whose total numel stays under `max_bucket_numel`.

    A parameter larger than the cap gets a bucket of its own; `max_bucket_numel <= 0` means one bucket.
    """
    buckets: List[List[int]] = []
    current: List[int] = []
    current_numel = 0
    for index, numel in enumerate(numels):
        if current and max_bucket_numel > 0 and current_numel + numel > max_bucket_numel:
            buckets.append(current)
            current, current_numel = [], 0
        current.append(index)
        current_numel += numel
    if current:
        buckets.append(current)
    return buckets

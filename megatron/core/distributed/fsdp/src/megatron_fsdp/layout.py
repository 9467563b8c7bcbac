"""Pure arithmetic of a row-aligned parameter group: which rows of which parameter each rank owns, and where.

Each parameter is chunked by rows (dim 0) over the `dp_size` ranks the way `torch.chunk` and DTensor's
`Shard(0)` cut it: every rank but possibly the trailing ones gets `ceil(rows / dp_size)` rows; trailing ranks
may get fewer or none. A 0-dim parameter counts as one row of one element (rank 0 owns it). A parameter's
*chunk* on a rank is padded to the same size on every rank, `chunk_numel = ceil(rows / dp_size) * row_numel`,
and a rank's *shard* is its chunks of every parameter of the group, end to end (plus a tail pad, see HFSDP
below). All ranks' shards have the same size, so a group is gathered with one all-gather into a rank-major
buffer and reduced with one reduce-scatter from one.

Two flat forms of the full group exist, of the same size `padded_numel = dp_size * shard_numel`:
- *gathered* (rank-major): rank `r`'s shard at `[r * shard_numel, (r + 1) * shard_numel)`; what an all-gather
  produces and a reduce-scatter consumes.
- *unsharded* (param-major): parameter `i` at `[dp_size * shard_offset_i, ... + numel_i)` (`spans[i]`), its
  padded region running to `dp_size * (shard_offset_i + chunk_numel_i)`: the contiguous full parameters the
  module computes with. In it, rank `r`'s rows of parameter `i` start at `dp_size * shard_offset_i + r *
  chunk_numel_i`, so going from one form to the other is one strided copy per parameter (resharding.py).

HFSDP shards the main weights a second time, over the `outer_size` ranks of the outer dim: each shard is cut
into `outer_size` equal *flat* sub-shards (the optimizer only needs flat main shards), the tail pad making the
shard size divide `outer_size`. With `outer_size=1` the sub-shard is the shard.
Nothing here touches torch.distributed; everything can be unit-tested without processes.
"""

import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple


def chunk_rows(num_rows: int, world_size: int, rank: int) -> Tuple[int, int]:
    """Rows `[start, end)` that `rank` holds when `num_rows` rows are split like `torch.chunk` / DTensor Shard(0).

    Every rank but possibly the trailing ones gets `ceil(num_rows / world_size)` rows; trailing ranks may get
    fewer or none.
    """
    rows_per_rank = math.ceil(num_rows / world_size) if num_rows else 0
    start = min(rank * rows_per_rank, num_rows)
    return start, min(start + rows_per_rank, num_rows)


@dataclass(frozen=True)
class ParamSpan:
    """Where one parameter sits in the unsharded (param-major) flat buffer: elements `[flat_start, flat_end)`."""

    flat_start: int
    flat_end: int
    shape: Tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.flat_end - self.flat_start


@dataclass(frozen=True)
class ParamChunk:
    """How one parameter is chunked: `rows` rows of `row_numel` elements, `rows_per_rank` (ceil) rows per rank,
    each rank's chunk padded to `chunk_numel` elements at `shard_offset` in every shard."""

    rows: int
    row_numel: int
    rows_per_rank: int
    chunk_numel: int
    shard_offset: int


@dataclass(frozen=True)
class LocalPiece:
    """The part of one parameter that a rank owns.

    `param_start:param_end` indexes the flattened parameter; `shard_start:shard_end` indexes the rank's shard
    (or sub-shard). Both ranges have the same length, which may be zero; for a whole shard the piece is
    the rank's rows."""

    param_start: int
    param_end: int
    shard_start: int
    shard_end: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


class GroupLayout:
    """Row chunks, offsets and padding for the parameters of one group sharded over `dp_size` ranks (and each
    shard again over `outer_size` outer ranks, for HFSDP's main weights)."""

    def __init__(self, shapes: Sequence[Sequence[int]], dp_size: int, outer_size: int = 1):
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        if outer_size < 1:
            raise ValueError(f"outer_size must be >= 1, got {outer_size}")
        self.dp_size, self.outer_size = dp_size, outer_size
        self.shapes = [tuple(shape) for shape in shapes]
        chunks, offset = [], 0
        for shape in self.shapes:
            rows = shape[0] if shape else 1  # a 0-dim parameter is one row of one element
            row_numel = math.prod(shape[1:]) if shape else 1
            rows_per_rank = math.ceil(rows / dp_size) if rows else 0
            chunks.append(ParamChunk(rows, row_numel, rows_per_rank, rows_per_rank * row_numel, offset))
            offset += rows_per_rank * row_numel
        self.chunks: List[ParamChunk] = chunks
        self.used_shard_numel = offset  # the chunks; the rest of a shard is the tail pad
        # At least one element per (sub-)shard, so every rank has something to communicate.
        self.sub_shard_numel = max(1, math.ceil(offset / outer_size))
        self.shard_numel = self.sub_shard_numel * outer_size
        self.padded_numel = self.shard_numel * dp_size
        self.spans: List[ParamSpan] = [
            ParamSpan(dp_size * chunk.shard_offset, dp_size * chunk.shard_offset + math.prod(shape), shape)
            for chunk, shape in zip(chunks, self.shapes)]
        self.numel = sum(span.numel for span in self.spans)

    @property
    def forms_coincide(self) -> bool:
        """Whether the gathered and unsharded forms are the same arrangement (one rank, or one parameter and
        no tail pad), so a gather can land in the unsharded buffer directly."""
        if self.dp_size == 1:
            return True
        return len(self.chunks) <= 1 and self.used_shard_numel == self.shard_numel

    # ---- rows ------------------------------------------------------------------------------------------------
    def row_range(self, param_index: int, rank: int) -> Tuple[int, int]:
        """Rows `[start, end)` of parameter `param_index` that `rank` owns (row 0 of a 0-dim one: rank 0)."""
        return chunk_rows(self.chunks[param_index].rows, self.dp_size, rank)

    def local_shape(self, param_index: int, rank: int) -> Tuple[int, ...]:
        """Shape of `rank`'s rows of the parameter (the local tensor of its Shard(0) DTensor); `()` for a 0-dim
        parameter."""
        shape = self.shapes[param_index]
        if not shape:
            return ()
        start, end = self.row_range(param_index, rank)
        return (end - start,) + shape[1:]

    # ---- shards ------------------------------------------------------------------------------------------------
    def shard_range(self, rank: int) -> Tuple[int, int]:
        """Elements `[start, end)` of the gathered (rank-major) buffer holding `rank`'s shard."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def sub_shard_offset(self, outer_rank: int) -> int:
        """Where outer rank `outer_rank`'s sub-shard starts inside a shard."""
        return outer_rank * self.sub_shard_numel

    def sub_shard_range(self, rank: int, outer_rank: int) -> Tuple[int, int]:
        """Elements `[start, end)` of the gathered buffer owned by outer rank `outer_rank` within `rank`'s shard."""
        start = rank * self.shard_numel + self.sub_shard_offset(outer_rank)
        return start, start + self.sub_shard_numel

    def local_piece(self, param_index: int, rank: int) -> LocalPiece:
        """`rank`'s rows of parameter `param_index`, in the parameter and in the rank's shard (possibly empty)."""
        chunk = self.chunks[param_index]
        start, end = self.row_range(param_index, rank)
        numel = (end - start) * chunk.row_numel
        return LocalPiece(start * chunk.row_numel, start * chunk.row_numel + numel, chunk.shard_offset,
                          chunk.shard_offset + numel)

    def sub_shard_piece(self, param_index: int, rank: int, outer_rank: int) -> LocalPiece:
        """The part of `rank`'s rows of parameter `param_index` inside sub-shard `outer_rank` of its shard (a flat
        range, possibly empty); its `shard_start:shard_end` index that sub-shard."""
        piece = self.local_piece(param_index, rank)
        low = self.sub_shard_offset(outer_rank)
        high = low + self.sub_shard_numel
        start, end = max(piece.shard_start, low), min(piece.shard_end, high)
        if end <= start:  # empty: placed at the edge of the sub-shard nearest the rows
            clamp = min(max(piece.shard_start, low), high)
            param_index_at = piece.param_start if clamp <= piece.shard_start else piece.param_end
            return LocalPiece(param_index_at, param_index_at, clamp - low, clamp - low)
        return LocalPiece(piece.param_start + start - piece.shard_start, piece.param_start + end - piece.shard_start,
                          start - low, end - low)

    def local_pieces(self, rank: int) -> List[LocalPiece]:
        return [self.local_piece(index, rank) for index in range(len(self.chunks))]

    def sub_shard_pieces(self, rank: int, outer_rank: int) -> List[LocalPiece]:
        return [self.sub_shard_piece(index, rank, outer_rank) for index in range(len(self.chunks))]

    def owners_of_param(self, param_index: int) -> List[int]:
        """Ranks whose shard holds at least one element of the parameter."""
        return [rank for rank in range(self.dp_size) if self.local_piece(param_index, rank).numel > 0]

    def padded_region(self, param_index: int) -> Tuple[int, int]:
        """Elements `[start, end)` of the unsharded buffer holding parameter `param_index` and its padding:
        `dp_size` chunks of `chunk_numel`, rank `r`'s at `start + r * chunk_numel`."""
        chunk = self.chunks[param_index]
        start = self.dp_size * chunk.shard_offset
        return start, start + self.dp_size * chunk.chunk_numel


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

"""`HyperCommGrid`: ranks laid out on an n-dimensional named grid, with process groups along chosen dimensions.

The grid covers ranks `rank_offset .. rank_offset + prod(shape) - 1`; the first dimension varies fastest (the
Megatron-Core convention, so `HyperCommGrid([tp, cp, dp, pp], ["tp", "cp", "dp", "pp"])` gives the groups of
`initialize_model_parallel`'s default order). `create_pg(["tp", "dp"])` creates one process group per
combination of the other dimensions (every rank of the world must call it, as `new_group` requires) and
returns the one holding this rank (None when the grid does not cover it); `get_pg` looks it up again.
"""

import math
from datetime import timedelta

import torch.distributed as dist

from megatron.core.rank_layout import RankGrid


class HyperCommGrid:
    """An n-dimensional grid of ranks (`shape`, one name per dimension in `dim_names`)."""

    def __init__(self, shape, dim_names, rank_offset=0, backend=None):
        shape, dim_names = list(shape), list(dim_names)
        if len(shape) != len(dim_names):
            raise ValueError(f"HyperCommGrid: shape {shape} and dim_names {dim_names} must have the same length")
        if len(set(dim_names)) != len(dim_names):
            raise ValueError(f"HyperCommGrid: dim_names {dim_names} repeat a name")
        if any(isinstance(size, bool) or not isinstance(size, int) or size < 1 for size in shape):
            raise ValueError(f"HyperCommGrid: shape {shape} must hold positive integers")
        if isinstance(rank_offset, bool) or not isinstance(rank_offset, int) or rank_offset < 0:
            raise ValueError(f"HyperCommGrid: rank_offset must be a non-negative int, got {rank_offset!r}")
        self.shape = shape
        self.dim_names = dim_names
        self.rank_offset = rank_offset
        self.backend = backend
        self.size = math.prod(shape)
        if dist.is_initialized() and rank_offset + self.size > dist.get_world_size():
            raise RuntimeError(
                f"HyperCommGrid: shape {shape} (size {self.size}) from rank_offset {rank_offset} needs "
                f"{rank_offset + self.size} ranks but the world has {dist.get_world_size()}; shrink the grid"
            )
        self._grid = RankGrid(dict(zip(dim_names, shape)), dim_names)
        self._pgs = {}

    def _order_dims(self, dims):
        """`dims` (a name or a list of names) in grid order, and the key its process group is stored under."""
        dims = [dims] if isinstance(dims, str) else list(dims)
        unknown = [dim for dim in dims if dim not in self.dim_names]
        if unknown:
            raise ValueError(f"HyperCommGrid: unknown dimensions {unknown}; the grid has {self.dim_names}")
        ordered = [dim for dim in self.dim_names if dim in dims]
        return ordered, "-".join(ordered)

    def _gen_rank_enum(self, dims):
        """The global rank lists along `dims`, one per combination of the other dimensions (first one fastest)."""
        ordered, _ = self._order_dims(dims)
        return [[rank + self.rank_offset for rank in ranks] for ranks in self._grid.groups(set(ordered))]

    def get_rank_enum(self, dims):
        return self._gen_rank_enum(dims)

    def create_pg(self, dims, timeout=None, pg_options=None, group_desc=None):
        """Create the process groups along `dims` (collective over the world); returns this rank's or None."""
        ordered, key = self._order_dims(dims)
        if key in self._pgs:
            raise KeyError(f"HyperCommGrid: the process group along {ordered} already exists; use get_pg({ordered})")
        if dist.is_initialized() and self.rank_offset + self.size > dist.get_world_size():
            raise RuntimeError(f"HyperCommGrid: the grid needs {self.rank_offset + self.size} ranks but the world "
                               f"has {dist.get_world_size()}")
        options = {"backend": self.backend, "pg_options": pg_options, "group_desc": group_desc}
        if timeout is not None:
            options["timeout"] = timeout if isinstance(timeout, timedelta) else timedelta(minutes=timeout)
        rank = dist.get_rank()
        mine = None
        for ranks in self._gen_rank_enum(ordered):
            group = dist.new_group(ranks=ranks, **options)
            if rank in ranks:
                mine = group
        self._pgs[key] = mine
        return mine

    def get_pg(self, dims):
        """The process group along `dims` created by `create_pg` (None when the grid does not cover this rank)."""
        ordered, key = self._order_dims(dims)
        if key not in self._pgs:
            raise KeyError(f"HyperCommGrid: no process group along {ordered}; call create_pg({ordered}) first")
        return self._pgs[key]

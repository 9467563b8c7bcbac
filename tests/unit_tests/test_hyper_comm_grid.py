"""HyperCommGrid: named grid dimensions (first fastest) and process groups along chosen ones."""

import pytest
import torch
import torch.distributed as dist

from megatron.core.hyper_comm_grid import HyperCommGrid
from tests.unit_tests.multiprocess_harness import run_on_ranks


def _grid_groups():
    grid = HyperCommGrid([2, 2], ["tp", "dp"])
    tp = grid.create_pg("tp")
    dp_tp = grid.create_pg(["dp", "tp"])  # stored in grid order: the same as ["tp", "dp"]
    with pytest.raises(KeyError, match="already exists"):
        grid.create_pg(["tp", "dp"])
    with pytest.raises(KeyError, match="call create_pg"):
        grid.get_pg("dp")
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value, group=grid.get_pg(["tp"]))
    # A grid over the last two ranks: ranks 0 and 1 get no group.
    tail = HyperCommGrid([2], ["dp"], rank_offset=2)
    tail_group = tail.create_pg("dp")
    return (dist.get_process_group_ranks(tp), dist.get_process_group_ranks(grid.get_pg(["tp", "dp"])),
            dp_tp is grid.get_pg("tp-dp".split("-")), value.item(),
            None if tail_group is None else dist.get_process_group_ranks(tail_group))


def test_grid_groups_on_four_ranks():
    results = run_on_ranks(4, _grid_groups)
    for rank, (tp, tp_dp, same, total, tail) in enumerate(results):
        assert tp == [rank - rank % 2, rank - rank % 2 + 1]
        assert tp_dp == [0, 1, 2, 3] and same
        assert total == sum(tp)
        assert tail == (None if rank < 2 else [2, 3])


def test_rank_enumeration_and_bad_grids():
    grid = HyperCommGrid([2, 3, 2], ["tp", "cp", "pp"], rank_offset=1)
    assert grid.size == 12
    assert grid.get_rank_enum("cp") == [[1, 3, 5], [2, 4, 6], [7, 9, 11], [8, 10, 12]]
    assert grid.get_rank_enum(["pp", "tp"]) == [[1, 2, 7, 8], [3, 4, 9, 10], [5, 6, 11, 12]]
    with pytest.raises(ValueError, match=r"unknown dimensions \['dp'\]"):
        grid.get_rank_enum("dp")
    with pytest.raises(ValueError, match="same length"):
        HyperCommGrid([2, 2], ["tp"])
    with pytest.raises(ValueError, match="positive integers"):
        HyperCommGrid([0], ["tp"])

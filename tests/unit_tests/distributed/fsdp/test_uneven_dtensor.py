"""`megatron_fsdp.uneven_dtensor` where a rank's local shard is empty (fewer rows than ranks: 1 row on 2 or 3
ranks, 2 rows on 3), and given a plain tensor where a DTensor is required.

Every piece `split_dtensor` returns must hold exactly this rank's part of the matching `torch.split` piece of
the full tensor (an empty block on a rank that owns none of it), assemble back to it with
`uneven_dtensor_to_full_tensor` / `gather_uneven_dtensor_to_full_tensor`, and save and load through
torch.distributed.checkpoint."""

import pytest
import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks

# (rows, columns, dim, sections): 1 row leaves the last rank without rows at 2 ranks, 1 or 2 rows at 3
SPLITS = ((1, 3, 0, [1]), (2, 3, 0, [1, 1]), (1, 4, 1, [3, 1]), (2, 5, 0, 1), (2, 5, 1, [2, 0, 3]))


def _full(rows, columns):
    return torch.arange(rows * columns, dtype=torch.float32).view(rows, columns) + 1.0


def _expected_block(full, rank, world, dim, start, end):
    """This rank's rows of `full` (torch.chunk's split) cut to `[start, end)` along `dim`."""
    rows_per_rank = -(-full.shape[0] // world)
    block = full[rank * rows_per_rank:(rank + 1) * rows_per_rank]
    return block.narrow(dim, start, end - start) if dim == 1 else block[max(start - rank * rows_per_rank, 0):
                                                                        max(end - rank * rows_per_rank, 0)]


def _splits_with_empty_local_shards(directory):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from megatron_fsdp.uneven_dtensor import (
        gather_uneven_dtensor_to_full_tensor,
        split_dtensor,
        uneven_dtensor_to_full_tensor,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    results = []
    for case, (rows, columns, dim, sections) in enumerate(SPLITS):
        full = _full(rows, columns)
        dtensor = distribute_tensor(full, mesh, [Shard(0)])
        pieces = split_dtensor(dtensor, sections, dim=dim, update_uneven_dtensor_chunk_meta=True)
        expected_pieces = torch.split(full, sections, dim=dim)
        bounds, start = [], 0
        for piece in expected_pieces:
            bounds.append((start, start + piece.shape[dim]))
            start += piece.shape[dim]
        locals_match = [torch.equal(piece.to_local(), _expected_block(full, rank, world, dim, low, high))
                        for piece, (low, high) in zip(pieces, bounds)]
        assembled = [torch.equal(uneven_dtensor_to_full_tensor(piece), expected)
                     and torch.equal(gather_uneven_dtensor_to_full_tensor(piece), expected)
                     for piece, expected in zip(pieces, expected_pieces)]
        shapes = [tuple(piece.shape) == tuple(expected.shape) for piece, expected in zip(pieces, expected_pieces)]
        # DCP: save the pieces, load them into the pieces of a zero tensor split the same way
        path = f"{directory}_{case}"
        dcp.save({f"piece{i}": piece for i, piece in enumerate(pieces)}, checkpoint_id=path)
        target = distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)])
        fresh = split_dtensor(target, sections, dim=dim, update_uneven_dtensor_chunk_meta=True)
        dcp.load({f"piece{i}": piece for i, piece in enumerate(fresh)}, checkpoint_id=path)
        reloaded = torch.equal(target.full_tensor(), full)
        empty_here = dtensor.to_local().numel() == 0
        results.append((locals_match, assembled, shapes, reloaded, empty_here))
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_split_dtensor_with_empty_local_shards(world_size, tmp_path):
    per_rank = run_on_ranks(world_size, _splits_with_empty_local_shards, str(tmp_path / "pieces"))
    for rank, results in enumerate(per_rank):
        assert len(results) == len(SPLITS)
        for case, (locals_match, assembled, shapes, reloaded, _) in zip(SPLITS, results):
            assert all(locals_match), (rank, case, locals_match)
            assert all(assembled), (rank, case, assembled)
            assert all(shapes) and reloaded, (rank, case)
    # the cases with fewer rows than ranks really leave the last rank without rows
    assert [results[-1] for results in per_rank[-1]] == [rows < world_size for rows, *_ in SPLITS]


def test_plain_tensors_are_refused_with_the_argument_named():
    from megatron_fsdp.uneven_dtensor import (
        gather_uneven_dtensor_to_full_tensor,
        local_block_offset,
        split_dtensor,
        uneven_dtensor_to_full_tensor,
    )

    plain = torch.ones(3, 2)
    calls = {"split_dtensor": lambda: split_dtensor(plain, [1, 2]),
             "uneven_dtensor_to_full_tensor": lambda: uneven_dtensor_to_full_tensor(plain),
             "gather_uneven_dtensor_to_full_tensor": lambda: gather_uneven_dtensor_to_full_tensor(plain),
             "local_block_offset": lambda: local_block_offset(plain)}
    for function, call in calls.items():
        with pytest.raises(ValueError, match=rf"{function}\(\): 'dtensor' must be a torch.distributed.tensor.DTensor"
                                             r", got a torch.Tensor"):
            call()

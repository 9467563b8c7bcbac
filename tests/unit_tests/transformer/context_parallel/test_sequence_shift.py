"""The left shift of a token-indexed tensor under context parallelism equals, on every rank, the shift of the full
sequence (torch.roll, its wrapped-around end replaced by the fill value) cut to the rank's two chunks: the
chunk-joining arithmetic for 1-4 ranks in one process, and the all-gather on a 2-rank gloo group."""

import pytest
import torch
import torch.distributed as dist

from megatron.core.transformer.context_parallel.sequence_shift import (
    chunk_heads,
    join_shifted_chunks,
    shift_left_across_cp_ranks,
)
from megatron.core.transformer.context_parallel.sequence_split import local_rows
from tests.unit_tests.multiprocess_harness import run_on_ranks

SEQ_LEN = 16


def _rolled(full: torch.Tensor, shift: int, fill) -> torch.Tensor:
    """The full sequence shifted left by `shift` along its last dim, the last `shift` positions set to `fill`."""
    shift = min(shift, full.shape[-1])
    rolled = torch.roll(full, -shift, dims=-1)
    if shift:
        rolled[..., full.shape[-1] - shift:] = fill
    return rolled


def _sequence(dtype):
    values = torch.arange(3 * SEQ_LEN).view(3, SEQ_LEN) + 1  # no zero: a wrongly filled position shows
    return values % 2 == 0 if dtype == torch.bool else values.to(dtype)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("step", [1, 2])
def test_joining_chunk_heads_equals_the_rolled_sequence(cp_size, step):
    full = _sequence(torch.int64)
    local = [local_rows(full, 1, cp_size, rank) for rank in range(cp_size)]
    every_ranks_heads = [chunk_heads(part, step) for part in local]  # what the all-gather hands every rank
    expected = _rolled(full, step, -7)
    for rank in range(cp_size):
        shifted = join_shifted_chunks(local[rank], step, every_ranks_heads, rank, fill=-7)
        assert torch.equal(shifted, local_rows(expected, 1, cp_size, rank)), (cp_size, step, rank)


def _shifts_on_this_rank():
    """{(dtype, shift, fill): (shifted, expected)} for this rank of a CP group spanning the world."""
    cp_size, cp_rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    results = {}
    for dtype in (torch.int64, torch.float32, torch.bool):
        full = _sequence(dtype)
        fill = False if dtype == torch.bool else 0
        # 4: exactly one chunk; 5 and 9: more than a chunk (several exchanges); 16 and 20: the whole sequence.
        for shift in (0, 1, 3, 4, 5, 9, 16, 20):
            local = local_rows(full, 1, cp_size, cp_rank)
            shifted = shift_left_across_cp_ranks(local, shift, group, fill)
            expected = local_rows(_rolled(full, shift, fill), 1, cp_size, cp_rank)
            results[str(dtype), shift] = (shifted.dtype == dtype, torch.equal(shifted, expected))
    return results


@pytest.mark.parametrize("world_size", [2])
def test_shift_across_two_ranks_equals_rolling_then_splitting(world_size):
    for results in run_on_ranks(world_size, _shifts_on_this_rank):
        assert len(results) == 24
        assert all(same_dtype and equal for same_dtype, equal in results.values()), results


def test_shift_rejects_tensors_with_gradients_and_odd_local_lengths():
    with pytest.raises(ValueError, match="does not require grad"):
        shift_left_across_cp_ranks(torch.zeros(1, 4, requires_grad=True), 1, None)
    with pytest.raises(ValueError, match=r"local sequence length is 5 \(odd\)"):
        shift_left_across_cp_ranks(torch.zeros(1, 5), 1, None)

"""Partition arithmetic and the tensor-parallel batch broadcast."""

import pytest
import torch

from megatron.core.tensor_parallel import VocabUtility, broadcast_data, divide, split_tensor_along_last_dim
from megatron.core.tensor_parallel.utils import strided_partition
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.tensor_parallel.tp_helpers import setup_tensor_parallel


def test_divide_and_split():
    assert divide(12, 4) == 3
    with pytest.raises(ValueError, match="10 is not divisible by 4"):
        divide(10, 4)
    parts = split_tensor_along_last_dim(torch.arange(12.0).reshape(2, 6), 3)
    assert [p.tolist() for p in parts] == [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]]


def test_strided_partition_interleaves_blocks():
    full = torch.arange(8).reshape(8, 1)
    assert strided_partition(full, 2, 0, 0, stride=1).flatten().tolist() == [0, 1, 2, 3]
    assert strided_partition(full, 2, 0, 0, stride=2).flatten().tolist() == [0, 1, 4, 5]
    assert strided_partition(full, 2, 1, 0, stride=2).flatten().tolist() == [2, 3, 6, 7]
    assert strided_partition(full.t(), 4, 3, 1).flatten().tolist() == [6, 7]


def test_vocab_ranges():
    assert VocabUtility.vocab_range_from_global_vocab_size(16, 2, 4) == (8, 12)
    assert VocabUtility.vocab_range_from_per_partition_vocab_size(5, 1, 2) == (5, 10)
    with pytest.raises(ValueError, match="vocabulary size 10 is not divisible by 4"):
        VocabUtility.vocab_range_from_global_vocab_size(10, 0, 4)


def _broadcast_from_rank_zero():
    _, rank, _ = setup_tensor_parallel()
    data = None
    if rank == 0:
        data = {"tokens": torch.arange(6).reshape(2, 3), "labels": torch.arange(4).reshape(1, 4) + 100}
    output = broadcast_data(["tokens", "labels"], data, torch.int64)
    return output["tokens"].tolist(), output["labels"].tolist()


@pytest.mark.parametrize("world_size", [2])
def test_broadcast_data(world_size):
    expected = ([[0, 1, 2], [3, 4, 5]], [[100, 101, 102, 103]])
    assert run_on_ranks(world_size, _broadcast_from_rank_zero) == [expected] * world_size


def test_broadcast_data_checks_the_dtype_on_one_rank_too():
    """As upstream, rank 0 checks every tensor's dtype at any tensor-parallel size, so a batch of the wrong dtype
    fails at TP1 as it would at TP2 instead of coming back unconverted."""
    tokens = torch.arange(6).view(2, 3)
    assert torch.equal(broadcast_data(["tokens"], {"tokens": tokens}, torch.int64)["tokens"], tokens)
    with pytest.raises(ValueError, match=r"broadcast_data: labels has dtype torch.float32, expected torch.int64"):
        broadcast_data(["tokens", "labels"], {"tokens": tokens, "labels": tokens.float()}, torch.int64)


def _broadcast_a_float_batch_as_int64():
    _, rank, _ = setup_tensor_parallel()
    data = {"tokens": torch.arange(4), "labels": torch.ones(4)} if rank == 0 else None
    with pytest.raises(ValueError) as error:
        broadcast_data(["tokens", "labels"], data, torch.int64)
    return str(error.value)


def test_broadcast_data_of_a_wrong_dtype_raises_on_every_rank():
    """Rank 0 used to raise alone while the other ranks waited for its broadcast."""
    rank_zero, rank_one = run_on_ranks(2, _broadcast_a_float_batch_as_int64, timeout_s=60)
    assert rank_zero == ("broadcast_data: labels has dtype torch.float32, expected torch.int64; convert it or pass "
                         "its dtype as datatype")
    assert rank_one == "broadcast_data: labels on tensor-parallel rank 0 does not have dtype torch.int64"


def _split_and_gather_1d_chunks():
    from megatron.core.tensor_parallel import gather_split_1d_tensor, split_tensor_into_1d_equal_chunks

    _, rank, tp = setup_tensor_parallel()
    full = torch.arange(6.0 * 4 * tp).reshape(6, 4 * tp)
    part = split_tensor_into_1d_equal_chunks(full)
    assert part.data_ptr() == full.view(-1)[rank * 24].data_ptr()  # a view of this rank's range
    copied = split_tensor_into_1d_equal_chunks(full, new_buffer=True)
    assert copied.data_ptr() != part.data_ptr() and torch.equal(copied, part)
    assert torch.equal(part, full.view(-1)[rank * 24 : (rank + 1) * 24])
    assert torch.equal(gather_split_1d_tensor(part), full.view(-1))
    with pytest.raises(ValueError, match="5 elements are not divisible by the tensor-parallel size 2"):
        split_tensor_into_1d_equal_chunks(torch.zeros(5))
    return True


def test_split_and_gather_1d_chunks_round_trip_at_tp2():
    assert run_on_ranks(2, _split_and_gather_1d_chunks) == [True, True]

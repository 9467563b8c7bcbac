"""`get_batch_on_this_cp_rank` with upstream's calling habits: the dict is updated in place and returned, the
group may be given as `cp_group` (here and through `megatron.core.utils`), and a sequence that does not cut into
2 x CP chunks is refused naming the batch entry."""

import pytest
import torch
import torch.distributed as dist

from megatron.core import utils
from megatron.core.transformer.context_parallel.sequence_split import get_batch_on_this_cp_rank
from tests.unit_tests.multiprocess_harness import run_on_ranks


def _batch():
    return {"tokens": torch.arange(16).view(2, 8), "labels": torch.arange(16).view(2, 8) + 1,
            "attention_mask": torch.zeros(2, 1, 8, 8, dtype=torch.bool), "dataset_id": torch.tensor([3, 4]),
            "source": "shard-0", "position_ids": None}


def test_the_batch_is_cut_in_place_and_returned_as_upstream():
    batch = _batch()
    mask, dataset_id = batch["attention_mask"], batch["dataset_id"]
    returned = get_batch_on_this_cp_rank(batch, cp_size=2, cp_rank=0)
    assert returned is batch
    assert batch["tokens"].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert batch["labels"].tolist() == [[1, 2, 7, 8], [9, 10, 15, 16]]
    assert batch["attention_mask"] is mask and batch["dataset_id"] is dataset_id
    assert batch["source"] == "shard-0" and batch["position_ids"] is None


def test_a_sequence_that_does_not_cut_into_two_cp_chunks_names_the_entry():
    batch = {"tokens": torch.zeros(2, 8, dtype=torch.long), "loss_mask": torch.ones(2, 6)}
    with pytest.raises(ValueError, match=r"batch\['loss_mask'\] has sequence length 6 \(dimension 1 of \(2, 6\)\), "
                                         r"which must be divisible by 2 x --context-parallel-size \(4\)"):
        get_batch_on_this_cp_rank(batch, cp_size=2, cp_rank=1)
    with pytest.raises(ValueError, match="either cp_group or cp_size and cp_rank"):
        get_batch_on_this_cp_rank(_batch(), cp_size=2, cp_rank=0, cp_group=object())


def _cut_with_cp_group():
    """parallel_state is not initialised: the sizes can only come from the group passed."""
    here = get_batch_on_this_cp_rank(_batch(), cp_group=dist.group.WORLD)["tokens"].tolist()
    core = utils.get_batch_on_this_cp_rank(_batch(), cp_group=dist.group.WORLD)["tokens"].tolist()
    return here, core


@pytest.mark.parametrize("world_size", [2])
def test_cp_group_keyword_picks_the_rank_and_size(world_size):
    expected = [[[0, 1, 6, 7], [8, 9, 14, 15]], [[2, 3, 4, 5], [10, 11, 12, 13]]]
    assert run_on_ranks(world_size, _cut_with_cp_group) == [(tokens, tokens) for tokens in expected]

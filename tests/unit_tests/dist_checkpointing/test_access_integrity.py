"""`save(..., validate_access_integrity=True)` (the default, as upstream): ShardedTensors whose main replicas do
not tile the tensor (a gap, two ranks on one piece, different global shapes) are refused, naming the key, on
every rank and before anything is written."""

import re

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.errors import CheckpointError
from tests.unit_tests.multiprocess_harness import run_on_ranks

ShardedTensor = dist_checkpointing.ShardedTensor


def test_a_gap_is_refused_and_can_be_allowed(tmp_path):
    half = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 3), (0, 0, 2))}
    with pytest.raises(CheckpointError, match="ShardedTensor 'w': the main replicas .* cover 6 of its 12 elements"):
        dist_checkpointing.save(half, tmp_path / "refused")
    assert not (tmp_path / "refused" / ".metadata").exists()
    dist_checkpointing.save(half, tmp_path / "allowed", validate_access_integrity=False)
    assert dist_checkpointing.check_is_distributed_checkpoint(tmp_path / "allowed")


def _save_each(directory, case):
    rank = torch.distributed.get_rank()
    entries = {
        "same_offset": ShardedTensor.from_rank_offsets("w", torch.ones(2, 3), (0, 0, 2)),
        "replicas_without_replica_id": ShardedTensor.from_rank_offsets("bias", torch.ones(3)),
        "shapes_differ": ShardedTensor.from_rank_offsets("w", torch.ones(2 + rank, 3), (0, rank, 2)),
        "tiled": ShardedTensor.from_rank_offsets("w", torch.ones(2, 3), (0, rank, 2)),
    }
    try:
        dist_checkpointing.save({"entry": entries[case], "bias": ShardedTensor.from_rank_offsets(
            "b", torch.ones(3), replica_id=rank)}, f"{directory}/{case}")
    except CheckpointError as error:
        return str(error)
    return None


@pytest.mark.parametrize("case, message", [
    ("same_offset", "ShardedTensor 'w': the main replicas \\(replica_id 0\\) of ranks 0 and 1 both hold"),
    ("replicas_without_replica_id", "ShardedTensor 'bias': the main replicas \\(replica_id 0\\) of ranks 0 and 1"),
    ("shapes_differ", "ShardedTensor 'w' has different global shapes on different ranks \\(rank 0: \\(4, 3\\), "
                      "rank 1: \\(6, 3\\)\\)"),
    ("tiled", None),
])
def test_ranks_that_do_not_tile_a_tensor_are_refused_on_every_rank(tmp_path, case, message):
    errors = run_on_ranks(2, _save_each, str(tmp_path), case)
    if message is None:
        assert errors == [None, None]
        assert torch.equal(dist_checkpointing.load_plain_tensors(tmp_path / case)["w"], torch.ones(4, 3))
    else:
        assert all(error is not None for error in errors), errors
        for error in errors:
            assert re.search(message, error), error

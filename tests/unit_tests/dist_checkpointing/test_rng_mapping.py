"""RNG states at another layout: each stream comes from the saved rank with the same coordinates along the dims
it is seeded from; the rest keep their seeded state and the load report names them, their ranks and why."""

import os

import pytest
import torch

from megatron.core.dist_checkpointing.rng_mapping import (
    MODEL_PARALLEL_STREAM,
    TRACKER_KEY,
    RankCoordinates,
    restored_state,
    stream_sources,
    summarize,
)
from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState
from tests.unit_tests.multiprocess_harness import run_on_ranks


def _grid(tensor, pipeline, data):
    """{rank: coordinates} in Megatron's default order (tensor fastest, then data, then pipeline)."""
    return {t + tensor * (d + data * p): RankCoordinates(t, p, d)
            for p in range(pipeline) for d in range(data) for t in range(tensor)}


def _sources(saved, current, dp_init=False, saved_dp_init=False):
    return {source.group.name: source.saved_rank for source in stream_sources(saved, current, dp_init, saved_dp_init)}


def test_same_layout_restores_every_rank_from_itself():
    saved = _grid(2, 2, 2)
    for rank, coordinates in saved.items():
        assert set(_sources(saved, coordinates).values()) == {rank}
        assert set(_sources(saved, coordinates, True, True).values()) == {rank}


def test_other_layouts_restore_what_maps():
    saved = _grid(2, 1, 2)  # TP2 x DP2
    # DP4 at TP1: every rank finds its pipeline and tensor-parallel rank 0; data ranks 2, 3 did not exist.
    assert _sources(saved, RankCoordinates(0, 0, 1)) == {
        "default generators": 2, "model-parallel stream": 2, "expert-parallel stream": 2}
    assert _sources(saved, RankCoordinates(0, 0, 3)) == {
        "default generators": 0, "model-parallel stream": 0, "expert-parallel stream": 0}
    # TP4: tensor-parallel ranks 2 and 3 did not exist; their default generators still map (pipeline rank 0).
    assert _sources(saved, RankCoordinates(3, 0, 0)) == {
        "default generators": 0, "model-parallel stream": None, "expert-parallel stream": None}
    # PP2: the second stage's streams were never seeded by the PP1 run.
    assert set(_sources(saved, RankCoordinates(0, 1, 0)).values()) == {None}
    # --data-parallel-random-init: streams are per data-parallel rank as well.
    dp_saved = _grid(1, 1, 2)
    assert set(_sources(dp_saved, RankCoordinates(0, 0, 1), True, True).values()) == {1}
    assert set(_sources(dp_saved, RankCoordinates(0, 0, 2), True, True).values()) == {None}
    reasons = {source.reason for source in stream_sources(dp_saved, RankCoordinates(0, 0, 0), True, False)}
    assert len(reasons) == 1 and "written without --data-parallel-random-init" in reasons.pop()


def test_restored_state_replaces_only_mapped_streams_and_report_groups_ranks():
    saved = _grid(1, 1, 1)
    sources = stream_sources(saved, RankCoordinates(1, 0, 0), False, False)
    current = {"torch_rng_state": "fresh", TRACKER_KEY: {MODEL_PARALLEL_STREAM: "fresh", "data-parallel-rng": "fresh"}}
    old = {"torch_rng_state": "saved", TRACKER_KEY: {MODEL_PARALLEL_STREAM: "saved", "data-parallel-rng": "saved"}}
    assert restored_state(current, {0: old}, sources) == {
        "torch_rng_state": "saved", TRACKER_KEY: {MODEL_PARALLEL_STREAM: "fresh", "data-parallel-rng": "saved"}}
    restored, not_restored = summarize([[("default generators", 0, ""), ("model-parallel stream", 0, "")],
                                        [("default generators", 0, ""), ("model-parallel stream", None, "why")]])
    assert restored == ["default generators on every rank", "model-parallel stream on rank 0"]
    assert not_restored == ["model-parallel stream on rank 1 (why; it keeps its seeded state)"]


def _save_at_dp2_load_at_tp2(workdir):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    from megatron.training import checkpointing, dist_checkpoint

    root = os.path.join(workdir, "ckpt")
    state = TrainingState("--ckpt-format torch_dist")
    torch.rand(7)  # move the streams past their seeded state, so that restored and fresh states differ
    with get_cuda_rng_tracker().fork():
        torch.rand(7)
    saved_torch, saved_tracker = torch.get_rng_state(), get_cuda_rng_tracker().get_states()
    state.args.save = root
    checkpointing.save_checkpoint(2, state.model, state.optimizer, state.scheduler, state.args)
    state.close()
    # Rank 0 of the TP2 run is (tensor 0, data 0), saved by rank 0; rank 1 is tensor-parallel rank 1, which
    # the DP2 run did not have. Both are pipeline rank 0: their default generators come from saved rank 0.
    state = TrainingState("--tensor-model-parallel-size 2 --ckpt-format torch_dist")
    fresh_tracker = get_cuda_rng_tracker().get_states()
    state.args.load = root
    _, report = dist_checkpoint.load_dist_checkpoint(state.model, state.optimizer, state.scheduler, state.args, 2)
    loaded_torch, loaded_tracker = torch.get_rng_state(), get_cuda_rng_tracker().get_states()
    state.close()
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, (saved_torch, saved_tracker))
    rank0_torch, rank0_tracker = gathered[0]
    model_parallel = loaded_tracker[MODEL_PARALLEL_STREAM]
    return {
        "default restored": torch.equal(loaded_torch, rank0_torch)
        and torch.equal(loaded_tracker["data-parallel-rng"], rank0_tracker["data-parallel-rng"]),
        "model-parallel restored": torch.equal(model_parallel, rank0_tracker[MODEL_PARALLEL_STREAM]),
        "model-parallel fresh": torch.equal(model_parallel, fresh_tracker[MODEL_PARALLEL_STREAM]),
        "report": report.lines(),
    }


@pytest.mark.world_size(2)
def test_load_at_another_layout_restores_mapped_streams_and_reports_the_rest(tmp_path):
    rank0, rank1 = run_on_ranks(2, _save_at_dp2_load_at_tp2, str(tmp_path))
    assert rank0["default restored"] and rank0["model-parallel restored"] and not rank0["model-parallel fresh"]
    assert rank1["default restored"] and rank1["model-parallel fresh"] and not rank1["model-parallel restored"]
    text = "\n".join(rank0["report"])
    assert ("RNG state: default generators on every rank; model-parallel stream on rank 0; expert-parallel "
            "stream on rank 0") in text
    assert ("RNG model-parallel stream on rank 1 (no rank of the checkpoint had pipeline rank 0, tensor-parallel "
            "rank 1; it keeps its seeded state)") in text

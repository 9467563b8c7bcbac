"""Per-arm summaries of the Megatron-FSDP benchmark from raw per-rank results, on hand-computed numbers."""

import pytest

from examples.megatron_fsdp import bench_summary


def _rank_result(comm_step):
    return {
        "error": None,
        "losses": [2.0, 1.5],
        "step_times": [1.0, 0.5],
        "warmup_steps": 1,
        "rss_lifetime_peak": 300,
        "rss_arm_peak": 200,
        "rss_baseline": 100,
        "state_bytes": {"params": 500, "grads": 500, "optimizer": 1000},
        "comm_per_step": [comm_step, comm_step],
    }


# ZeRO-3 on 2 ranks with psi = 1000 bytes: all-gathers of 1000 bytes for forward and again for backward, and a
# reduce-scatter of 1000 bytes; each sends half of its buffer to the one peer.
POINT_TO_POINT_STEP = {
    "calls": {"point_to_point": 3},
    "payload_bytes": {"point_to_point": 1500},
    "wire_bytes": 1500.0,
    "volume_bytes": 3000.0,  # 1500 * 2 / (2 - 1)
}
# The same step as recorded before the counter kept its volume: stock collectives only.
COLLECTIVES_ONLY_STEP = {
    "calls": {"all_gather": 2, "reduce_scatter": 1},
    "payload_bytes": {"all_gather": 2000, "reduce_scatter": 1000},
    "wire_bytes": 1500.0,
}


@pytest.mark.parametrize("comm_step", [POINT_TO_POINT_STEP, COLLECTIVES_ONLY_STEP], ids=["p2p", "old_raw_json"])
def test_summary_volume_comes_from_the_counter_or_from_old_payloads(comm_step):
    results = {"default": {"mfsdp3": [[_rank_result(comm_step), _rank_result(comm_step)]]}}
    summary = bench_summary.summarise(results, ["mfsdp3"], 1000, 2, "default", in_process=False)["mfsdp3"]
    assert summary["volume"] == 3000
    assert summary["theory_volume"] == 3000
    assert summary["wire_bytes"] == 1500.0
    assert summary["comm_payloads"] == comm_step["payload_bytes"]
    assert summary["comm_calls"] == comm_step["calls"]
    assert summary["comm_steady"] is True
    assert summary["step_time"] == 0.5

"""ZeRO theory formulas, summaries and target verdicts of the Megatron-FSDP benchmark, on hand-computed numbers."""

import pytest

from examples.megatron_fsdp import bench_theory
from examples.megatron_fsdp.bench_theory import MIB


@pytest.mark.parametrize(
    "strategy, expected",
    [
        (0, {"params": 1000, "grads": 1000, "optimizer": 2000}),
        (1, {"params": 1000, "grads": 1000, "optimizer": 500}),
        (2, {"params": 1000, "grads": 250, "optimizer": 500}),
        (3, {"params": 250, "grads": 250, "optimizer": 500}),
    ],
)
def test_zero_state_bytes_per_rank(strategy, expected):
    assert bench_theory.zero_state_bytes(strategy, param_bytes=1000, world_size=4) == expected


def test_zero_state_bytes_rejects_unknown_strategy():
    with pytest.raises(ValueError, match="zero strategy"):
        bench_theory.zero_state_bytes(4, 1000, 2)


@pytest.mark.parametrize(
    "strategy, regathered, payloads, volume",
    [
        (0, None, {"all_reduce": 1000}, 2000),
        (1, None, {"reduce_scatter": 1000, "all_gather": 1000}, 2000),
        (2, None, {"reduce_scatter": 1000, "all_gather": 1000}, 2000),
        (3, None, {"reduce_scatter": 1000, "all_gather": 2000}, 3000),
        (3, 0, {"reduce_scatter": 1000, "all_gather": 1000}, 2000),
        (3, 400, {"reduce_scatter": 1000, "all_gather": 1400}, 2400),
    ],
)
def test_zero_comm_payloads_and_volume(strategy, regathered, payloads, volume):
    computed = bench_theory.zero_comm_payloads(strategy, 1000, regathered)
    assert computed == payloads
    assert bench_theory.comm_volume(computed) == volume


def test_wire_bytes_per_rank_on_a_ring():
    # all-reduce of 1000 bytes on 4 ranks: reduce-scatter + all-gather, each sends 3/4 of the payload.
    assert bench_theory.wire_bytes_per_rank("all_reduce", 1000, 4) == 1500.0
    assert bench_theory.wire_bytes_per_rank("all_gather", 1000, 2) == 500.0
    assert bench_theory.wire_bytes_per_rank("reduce_scatter", 900, 3) == 600.0
    assert bench_theory.wire_bytes_per_rank("all_reduce", 1000, 1) == 0.0


def test_point_to_point_bytes_are_wire_and_scale_up_to_volume():
    # 600 bytes sent in a group of 4 are on the wire as they are; as a ring volume they are 600 * 4 / 3.
    assert bench_theory.wire_bytes_per_rank("point_to_point", 600, 4) == 600.0
    assert bench_theory.volume_bytes("point_to_point", 600, 4) == 800.0
    assert bench_theory.volume_bytes("point_to_point", 600, 2) == 1200.0
    assert bench_theory.volume_bytes("point_to_point", 600, 1) == 0.0
    # Collectives keep their weighted payload as volume, whatever the group size.
    assert bench_theory.volume_bytes("all_reduce", 1000, 4) == 2000
    assert bench_theory.volume_bytes("all_gather", 1000, 1) == 1000


def test_counted_step_volume_prefers_the_counter_and_falls_back_to_payloads():
    recorded = {"payload_bytes": {"point_to_point": 600, "all_reduce": 100}, "volume_bytes": 1000.0}
    assert bench_theory.counted_step_volume(recorded) == 1000.0
    # Raw results written before the counter kept its volume: collectives only, volume from payloads.
    assert bench_theory.counted_step_volume({"payload_bytes": {"all_reduce": 100, "all_gather": 300}}) == 500
    with pytest.raises(ValueError, match="group size"):
        bench_theory.comm_volume({"point_to_point": 600})


def test_step_time_summaries():
    assert bench_theory.slowest_rank_step_times([[1.0, 5.0, 2.0], [2.0, 3.0, 2.5]]) == [2.0, 5.0, 2.5]
    assert bench_theory.median_after_warmup([10.0, 1.0, 3.0, 2.0], 1) == 2.0
    assert bench_theory.median_after_warmup([10.0, 4.0], 2) == 7.0  # nothing left after warm-up: all steps
    assert bench_theory.max_abs_difference([1.0, 2.5, 3.0], [1.0, 2.0, 3.25]) == 0.5
    assert bench_theory.ratio(3.0, 2.0) == 1.5
    assert bench_theory.ratio(None, 2.0) is None
    with pytest.raises(ValueError, match="length"):
        bench_theory.max_abs_difference([1.0], [1.0, 2.0])


def _arm(strategy, **fields):
    summary = {"zero_strategy": strategy, "error": None}
    summary.update(fields)
    return summary


def test_evaluate_targets_pass_and_fail():
    theory_state = bench_theory.zero_state_bytes(3, 100 * MIB, 2)
    arms = {
        "ddp": _arm(None, step_time=1.0, rss_neutral=1000 * MIB),
        "fsdp2": _arm(None, step_time=1.2, rss_neutral=700 * MIB),
        "mfsdp1": _arm(1, error="megatron_fsdp not available: boom"),
        "mfsdp3": _arm(
            3,
            step_time=1.1,  # 0.92 x FSDP2: fails the 0.80 limit; 1.10 x DDP: passes the 1.15 limit
            loss_max_abs_diff=2e-6,
            volume=305 * MIB,  # 1.7% over 300 MiB theory: passes
            theory_volume=300 * MIB,
            state={"params": 52 * MIB, "grads": 50 * MIB, "optimizer": 100 * MIB},  # 4% over on params: passes
            theory_state=theory_state,
            rss_neutral=600 * MIB,  # 0.86 x FSDP2: passes
        ),
    }
    verdicts = {target: result for target, result, _ in bench_theory.evaluate_targets(arms)}
    assert verdicts == {
        "mfsdp1 runs": "FAIL",
        "mfsdp3 loss equals DDP within 1e-05": "pass",
        "mfsdp3 comm volume at most ZeRO theory + 2%": "pass",
        "mfsdp3 state bytes within 5% of ZeRO theory": "pass",
        "mfsdp3 step time <= 0.80 x FSDP2": "FAIL",
        "mfsdp3 step time <= 1.15 x DDP": "pass",
        "mfsdp3 allocator-neutral peak RSS <= 0.90 x FSDP2": "pass",
    }
    worse_state = {**arms["mfsdp3"]["state"], "grads": 60 * MIB}
    arms["mfsdp3"].update(loss_max_abs_diff=1e-3, volume=310 * MIB, state=worse_state, rss_neutral=650 * MIB)
    verdicts = {target: result for target, result, _ in bench_theory.evaluate_targets(arms)}
    assert verdicts["mfsdp3 loss equals DDP within 1e-05"] == "FAIL"
    assert verdicts["mfsdp3 comm volume at most ZeRO theory + 2%"] == "FAIL"
    assert verdicts["mfsdp3 state bytes within 5% of ZeRO theory"] == "FAIL"
    assert verdicts["mfsdp3 allocator-neutral peak RSS <= 0.90 x FSDP2"] == "FAIL"

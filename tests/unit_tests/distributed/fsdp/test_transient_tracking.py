"""The peak of transient bytes (`memory_report()["transient_peak"]`) is tracked over the groups noted as holding
transient memory, not by summing every group at every gather: after each update it must equal the peak of the
full sum over all groups, whatever the strategy, overlap, microbatching, double-buffer pool or gather codec."""

import pytest

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.distributed.fsdp.test_gather_codec import _bf16_codec_policy
from tests.unit_tests.multiprocess_harness import run_on_ranks

CASES = [dict(zero_dp_strategy=strategy) for strategy in (0, 1, 2, 3)] + [
    dict(zero_dp_strategy=3, overlap_grad_reduce=False, overlap_param_gather=False),
    dict(zero_dp_strategy=3, fsdp_double_buffer=True), dict(zero_dp_strategy=3, gather_codec="bf16")]


def _full_sum(schedule):
    current = sum(group.transient_bytes() for group in schedule.groups)
    current += sum(entry[2].numel() * entry[2].element_size() for entry in schedule.pending_reduces
                   if not any(entry[2] is group.grad_buffer for group in schedule.groups))
    current += sum(flat.numel() * flat.element_size() for held in schedule.held_reduces.values() for _, flat in held)
    if schedule.pool is not None:
        current += schedule.pool.total_bytes()
    return current


def _peaks_tracked_and_summed():
    import megatron_fsdp
    from megatron_fsdp.schedule import Schedule

    results = []
    track = Schedule._track_transient
    records = []

    def checked_track(schedule):
        track(schedule)
        records[-1]["summed"] = max(records[-1]["summed"], _full_sum(schedule))
        records[-1]["pairs"].append((schedule.peak_transient_bytes, records[-1]["summed"]))

    Schedule._track_transient = checked_track
    try:
        for case in CASES:
            records.append({"summed": 0, "pairs": []})
            module = models.make_model(0)
            if case.get("gather_codec") == "bf16":
                config = megatron_fsdp.DistributedDataParallelConfig(
                    data_parallel_sharding_strategy="optim_grads_params")
                model = megatron_fsdp.MegatronFSDP(module, config, fsdp_unit_modules=[models.Block],
                                                   gather_codec=_bf16_codec_policy([]))
                optimizer = models.make_optimizer([p for p in model.parameters() if p.requires_grad])
                megatron_fsdp.fully_shard_optimizer(optimizer)
            else:
                model, optimizer = megatron_fsdp.fully_shard(
                    module, models.make_optimizer(list(module.parameters())), fsdp_unit_modules=[models.Block],
                    **case)
            losses = models.train_sharded(model, optimizer, 1, microbatches=2)
            pairs = records[-1]["pairs"]
            results.append((str(case), losses, len(pairs), [pair for pair in pairs if pair[0] != pair[1]],
                            model.memory_report()["transient_peak"]))
    finally:
        Schedule._track_transient = track
    return results


@pytest.mark.parametrize("world_size", [2])
def test_tracked_transient_peak_equals_the_full_sum(world_size):
    reference, _ = models.reference_losses(1)
    for results in run_on_ranks(world_size, _peaks_tracked_and_summed):
        for case, losses, updates, differing, peak in results:
            # the codec sends the selected weights as bf16: those compute weights are the main weights rounded
            tolerance = 2e-3 if "gather_codec" in case else 1e-5
            assert max(abs(a - b) / abs(b) for a, b in zip(losses, reference)) < tolerance, (case, losses, reference)
            assert updates > 0, case
            assert differing == [], (case, differing[:3])
            assert peak > 0 or "'zero_dp_strategy': 0" in case, (case, peak)

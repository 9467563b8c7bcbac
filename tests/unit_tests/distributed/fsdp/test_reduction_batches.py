"""Gradient reductions in flight are counted per unit, and a group sharded over one rank reduces at launch
(grad_reduction.py); a unit's gradients are written into its flat buffer together after the unit's backward, never
stashed (grad_buffers.py).

The toy MoE model of `test_expert_data_parallel` at EP2 on 2 ranks under ZeRO-3 (expert-DP 1): its MoE layer is one
unit holding a dense group sharded over both ranks and an expert group sharded over one. The expert reduction is a
local add: it must neither wait for the dense reduction launched just before it (which would end the overlap of
that reduce-scatter with the rest of the backward) nor sit in the in-flight list. Training itself is held to the
one-process reference by `test_expert_parallel.py` (the `ep2_edp1-z3` case).
"""

from tests.unit_tests.distributed import test_expert_data_parallel as expert_training
from tests.unit_tests.multiprocess_harness import run_on_ranks


def _reductions_and_stashes():
    run = expert_training.TrainingRun(2, "megatron_fsdp_z3")
    schedule = run.ddp.fsdp.schedule
    # each reduction issued on its own, as a model of larger groups does (test_coalesced_reductions.py holds them)
    schedule.coalesce_reduce_bytes = 0
    launches, waits, stashed = [], [0], []
    launch, wait_oldest = schedule.launch_reduce, schedule._wait_oldest_reduce

    def counted_wait():
        waits[0] += 1
        wait_oldest()

    def recorded_launch(group, async_op):
        before = waits[0]
        launch(group, async_op)
        in_flight = [(entry[3].unit_index, entry[3].expert) for entry in schedule.pending_reduces]
        launches.append(((group.unit_index, group.expert), waits[0] - before, in_flight))

    def recording_take(group, take):
        def take_accumulated_grads(indices, grads, scale):
            take(indices, grads, scale)
            stashed.append(len(group.stashed_grads))
        return take_accumulated_grads

    schedule._wait_oldest_reduce, schedule.launch_reduce = counted_wait, recorded_launch
    for group in run.ddp.fsdp.groups:
        if group.unit_index is not None:
            group.take_accumulated_grads = recording_take(group, group.take_accumulated_grads)
    run.train(range(2))
    return launches, stashed, [(g.unit_index, g.expert, g.topology.dp_size) for g in run.ddp.fsdp.groups]


def test_expert_reductions_at_expert_dp_1_neither_wait_nor_stay_in_flight():
    for launches, stashed, groups in run_on_ranks(2, _reductions_and_stashes):
        units = {unit for unit, _, _ in groups if unit is not None}
        assert {(unit, True, 1) for unit in units} <= set(groups)  # each MoE unit has an expert group at expert-DP 1
        expert_launches = [entry for entry in launches if entry[0][1]]
        assert len(expert_launches) == 2 * len(units)  # one per unit and step
        for (unit, expert), waited, in_flight in launches:
            assert not any(is_expert for _, is_expert in in_flight)  # a local reduction holds nothing in flight
            if expert:
                assert waited == 0, launches
            # in flight after a launch: the reductions of at most one batch (one unit, or one root group)
            assert len({batch for batch, _ in in_flight}) <= 1, launches
        # the dense reduction of a unit is still in flight after its expert reduction, which follows it
        for index, ((unit, expert), _, in_flight) in enumerate(launches):
            if expert and index and launches[index - 1][0] == (unit, False):
                assert in_flight == [(unit, False)], launches
        assert stashed and max(stashed) == 0  # no gradient of a unit group was stashed

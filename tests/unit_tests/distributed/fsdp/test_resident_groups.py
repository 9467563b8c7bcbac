"""A strategy-3 parameter group sharded over one rank is resident (param_and_grad_buffer.py): its shard is the
whole group, so the compute buffer *is* the compute shard, keeps its storage, and a gather or release moves no
bytes; with no outer dim its gradients go straight into the main gradients (grad_buffers.py), as the local
"reduction" would only have added a flat buffer into them.

The layout checks build groups directly (no processes). The training check is the toy MoE model of
`test_expert_data_parallel` at EP2 on 2 ranks under ZeRO-3, whose expert groups are sharded over one rank
(expert-DP 1); its parity with the one-process reference is `test_expert_parallel.py`'s `ep2_edp1-z3` case.
"""

import pytest
import torch
import torch.nn as nn

from tests.unit_tests.distributed import test_expert_data_parallel as expert_training
from tests.unit_tests.multiprocess_harness import run_on_ranks


def _group(dp_size=1, param_dtype=torch.float32, strategy="optim_grads_params", **kwargs):
    from megatron_fsdp.distributed_data_parallel_config import ShardingStrategy
    from megatron_fsdp.mixed_precision import MixedPrecisionPolicy
    from megatron_fsdp.param_and_grad_buffer import ParamGroup

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(6, 5).to(param_dtype)), nn.Parameter(torch.randn(5).to(param_dtype))]
    return ParamGroup(params, ["weight", "bias"], strategy=ShardingStrategy[strategy], dp_rank=0,
                      dp_size=dp_size, device=torch.device("cpu"), policy=MixedPrecisionPolicy(), unit_index=0,
                      **kwargs)


def _storage_bytes(tensor):
    return tensor.untyped_storage().nbytes()


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_a_one_rank_group_under_strategy_3_keeps_its_weights_in_place(param_dtype):
    group = _group(param_dtype=param_dtype)
    assert group.resident
    assert group.compute_buffer is group.compute_shard
    # fp32: the main weights are the compute buffer too; bf16: fp32 main weights of their own
    assert (group.main_weights is group.compute_buffer) == (param_dtype == torch.float32)
    assert group.main_weights.dtype == torch.float32
    full_bytes = 30 * 2 + 5 * 2 if param_dtype == torch.bfloat16 else (30 + 5) * 4
    assert _storage_bytes(group.compute_buffer) == full_bytes
    group.param_view(0).fill_(3.0)
    issued = []
    for _ in range(2):
        group.release_compute()
        assert not group.gathered
        assert _storage_bytes(group.compute_buffer) == full_bytes  # nothing dropped
        group.start_gather(lambda output, shard: issued.append("all-gather"),
                           lambda outputs, pieces: issued.append("in place"))
        assert group.gathered and group.pending_gather is None
    assert issued == []  # no collective was asked for
    assert torch.equal(group.param_view(0), torch.full((6, 5), 3.0, dtype=param_dtype))  # the values stayed
    assert group.compute_bytes_held() == 0 and group.transient_bytes() == 0
    persistent = group.persistent_bytes()
    assert persistent["compute_weights"] == (full_bytes if param_dtype == torch.bfloat16 else 0)
    assert persistent["main_weights"] == (30 + 5) * 4


def test_groups_that_shard_or_place_their_weights_elsewhere_are_not_resident():
    from megatron_fsdp.offload import ShardOffload

    assert not _group(dp_size=2).resident  # sharded over two ranks: gathered and released
    assert not _group(strategy="optim_grads").resident  # strategies 0-2 keep their compute weights anyway
    assert not _group(outer_size=2).resident  # HFSDP: the compute shard is rebuilt from the outer ranks
    assert not _group(offload=ShardOffload.for_device("cpu", can_pin=False)).resident  # shards rest on the host
    assert not _group(compute_buffer=torch.zeros(35)).resident  # gathers into a double-buffer slot
    released = _group(dp_size=2)
    released.release_compute()
    assert _storage_bytes(released.compute_buffer) == 0


def _expert_groups_at_expert_dp_1():
    run = expert_training.TrainingRun(2, "megatron_fsdp_z3")
    groups = run.ddp.fsdp.groups
    experts = [group for group in groups if group.expert]
    pointers = {id(group): group.compute_buffer.data_ptr() for group in experts}
    transient_seen, added_per_call = [], []
    for group in experts:
        write, add = group.write_grad, group.take_accumulated_grads

        def recorded_write(index, grad, scale, group=group, write=write):
            write(index, grad, scale)
            transient_seen.append(group.transient_grads is not None)

        def recorded_add(indices, grads, scale, group=group, add=add):
            add(indices, grads, scale)
            transient_seen.append(group.transient_grads is not None)
            added_per_call.append(len(indices))
        group.write_grad, group.take_accumulated_grads = recorded_write, recorded_add
    run.train(range(2))
    return {
        # the gradients of a unit's expert group reach it in one call, after the unit's backward
        "added_per_call": sorted(set(added_per_call)),
        "expert_params": sorted({len(group.params) for group in experts}),
        "grads_left": any(param.grad is not None for group in experts for param in group.params),
        "resident": [(group.expert, group.resident, group.grads_into_main) for group in groups],
        "same_storage": all(group.compute_buffer.data_ptr() == pointers[id(group)]
                            and group.compute_buffer.data_ptr() == group.main_weights.data_ptr()
                            for group in experts),
        "transient_seen": transient_seen,
    }


def test_expert_groups_at_expert_dp_1_stay_in_place_and_take_gradients_directly():
    for result in run_on_ranks(2, _expert_groups_at_expert_dp_1):
        assert {(expert, resident, direct) for expert, resident, direct in result["resident"]} == {
            (False, False, False), (True, True, True)}
        assert result["same_storage"]  # the experts' weights never moved, and are the optimizer's main weights
        assert result["transient_seen"] and not any(result["transient_seen"])  # no flat gradient buffer
        assert result["added_per_call"] == result["expert_params"] and not result["grads_left"]

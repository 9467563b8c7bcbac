"""Megatron-FSDP with expert parallelism: expert parameters get parameter groups of their own, sharded,
gathered and reduced over the expert data-parallel group, while the dense ones stay on DP x CP.

The toy MoE model of `test_expert_data_parallel` (4 experts, top-1, the MoE layer one FSDP unit holding a dense
router group and an expert group) trains at EP2 on 2 ranks (expert-DP 1: each rank holds its experts whole) and
on 4 ranks (expert-DP 2: each expert's rows split over two ranks) under ZeRO-1 and ZeRO-3 (on 4 ranks also ZeRO-2,
and ZeRO-3 averaging in the collectives), on the same global batch as the one-process reference that DDP at EP1
is held to there: losses, grad norms (clipping on) and zero counts per step, and the final weights, within 1e-5;
the memory line's expert bytes by the sharding theory. A torch_dist checkpoint saved by Megatron-FSDP at EP2 x
expert-DP2 resumes under DDP at EP1 like the uninterrupted run.
"""

import megatron_fsdp
import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.dist_checkpointing import test_expert_resharding as expert_resharding
from tests.unit_tests.distributed import test_expert_data_parallel as expert_training
from tests.unit_tests.multiprocess_harness import run_on_ranks

EXPERT_PARALLEL = 2


def _group_layout(adapter):
    """(expert?, shard group size) of every parameter group, and the expert groups' parameter names."""
    groups = adapter.fsdp.groups
    layout = sorted({(group.expert, group.topology.dp_size) for group in groups})
    expert_names = sorted(name for group in groups if group.expert for name in group.names)
    return layout, expert_names


def _train_at_ep2(wrapper):
    from megatron.training.training_log import memory_usage

    run = expert_training.TrainingRun(EXPERT_PARALLEL, wrapper)
    layout, expert_names = _group_layout(run.ddp)
    shard_groups = run.ddp.expert_grad_shard_groups()
    history = run.train(range(expert_training.STEPS))
    memory = memory_usage([run.ddp], run.optimizer, torch.device("cpu"))
    with pytest.raises(ValueError, match="expert-parallel group"):  # the package alone cannot count experts once
        megatron_fsdp.clip_grad_norm_(run.ddp.fsdp, 1.0)
    expert_memory = {key: value for key, value in memory.items() if key.startswith("expert_")}
    return layout, expert_names, [dist.get_world_size(group) for group in shard_groups], expert_memory, history, \
        run.global_parameters()


def _check_history(history, expected_history):
    for (loss, norm, zeros), (expected_loss, expected_norm, expected_zeros) in zip(history, expected_history,
                                                                                  strict=True):
        assert loss == pytest.approx(expected_loss, rel=1e-5)
        assert norm == pytest.approx(expected_norm, rel=1e-5)
        assert zeros == expected_zeros


def _check_params(params, expected_params):
    assert sorted(params) == sorted(expected_params)
    for name, expected in expected_params.items():
        torch.testing.assert_close(params[name], expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("world_size, wrapper", [(2, "megatron_fsdp_z1"), (2, "megatron_fsdp_z3"),
                                                 (4, "megatron_fsdp_z1"), (4, "megatron_fsdp_z2"),
                                                 (4, "megatron_fsdp_z3"), (4, "megatron_fsdp_z3_average")],
                         ids=["ep2_edp1-z1", "ep2_edp1-z3", "ep2_edp2-z1", "ep2_edp2-z2", "ep2_edp2-z3",
                              "ep2_edp2-z3_average"])
def test_megatron_fsdp_expert_parallel_trains_like_one_process(world_size, wrapper):
    expected_history, expected_params = expert_training.uninterrupted_reference()
    assert any(norm > expert_training.CLIP_GRAD for _, norm, _ in expected_history)  # clipping is exercised
    results = run_on_ranks(world_size, _train_at_ep2, wrapper)
    expert_data_parallel = world_size // EXPERT_PARALLEL
    # fp32 bytes of this rank's experts: 1/EP of all, its shard of them 1/expert-DP of that (the rows split evenly)
    local = 4 * sum(param.numel() for name, param in expected_params.items() if ".local_experts." in name) // (
        EXPERT_PARALLEL)
    shard = local // expert_data_parallel
    for layout, expert_names, shard_group_sizes, memory, _, _ in results:
        # dense groups over every rank, expert groups over the ranks holding the same experts
        assert layout == [(False, world_size), (True, expert_data_parallel)]
        assert expert_names == [f"mlp.experts.local_experts.{j}.linear_fc{k}.{kind}"
                                for j in range(2) for k in (1, 2) for kind in ("bias", "weight")]
        assert shard_group_sizes == ([expert_data_parallel] if expert_data_parallel > 1 else [])
        # ZeRO-3 shards weights and gradients, ZeRO-2 gradients, ZeRO-1 only Adam's two moments; fp32 main
        # weights are the weights
        assert memory == {"expert_params_bytes": local if wrapper in ("megatron_fsdp_z1", "megatron_fsdp_z2")
                          else shard,
                          "expert_grads_bytes": local if wrapper == "megatron_fsdp_z1" else shard,
                          "expert_optimizer_state_bytes": 2 * shard}
    _, _, _, _, history, params = results[0]
    _check_history(history, expected_history)
    _check_params(params, expected_params)


@pytest.mark.world_size(4)
def test_megatron_fsdp_ep2_checkpoint_resumes_under_ddp_ep1(tmp_path):
    expected_history, expected_params = expert_training.uninterrupted_reference()
    save_after = expert_resharding.SAVE_AFTER
    keys, history, params = run_on_ranks(4, expert_resharding._save_then_resume, str(tmp_path / "ckpt"),
                                         (EXPERT_PARALLEL, "megatron_fsdp_z3"), (1, "ddp"))[0]
    # every expert saved once under its global index, with its Adam moments
    assert {key for key in keys if key.startswith("model.") and ".local_experts." in key} == {
        f"model.{name}" for name in expected_params if ".local_experts." in name}
    assert "optimizer.state.mlp.experts.local_experts.3.linear_fc2.weight.exp_avg_sq" in keys
    _check_history(history, expected_history[save_after:])
    _check_params(params, expected_params)


def _expert_stats_group_sizes_with_a_dense_first_chunk():
    """An interleaved-pipeline-like rank whose first chunk holds no MoE layer: the optimizer must take the expert
    shard groups from the chunk that has expert groups (expert-DP 1 here: none), not the dense chunk's DP group."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import MegatronFSDPAdapter
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from tests.unit_tests.distributed.expert_toy_model import ToyMoELayer, ToyMoEModel

    parallel_state.initialize_model_parallel(expert_model_parallel_size=EXPERT_PARALLEL)
    config = ModelParallelConfig(expert_model_parallel_size=EXPERT_PARALLEL)
    ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True,
                                               data_parallel_sharding_strategy="optim_grads_params")
    dense = MegatronFSDPAdapter(config, ddp_config, torch.nn.Sequential(torch.nn.Linear(4, 4)),
                                fsdp_unit_modules=(torch.nn.Linear,))
    moe = MegatronFSDPAdapter(config, ddp_config,
                              ToyMoEModel(ep_group=parallel_state.get_expert_model_parallel_group()),
                              fsdp_unit_modules=(ToyMoELayer,))
    optimizer = get_megatron_optimizer(expert_training._optimizer_config(False), [dense, moe])
    return [dist.get_world_size(group) for group in optimizer.expert_grad_stats_groups], \
        dist.get_world_size(parallel_state.get_model_parallel_group())


@pytest.mark.world_size(2)
def test_expert_statistics_take_the_expert_shard_groups_of_a_chunk_with_experts():
    for sizes, model_parallel in run_on_ranks(2, _expert_stats_group_sizes_with_a_dense_first_chunk):
        # expert tensor x expert x pipeline parallel (ETP = TP here); no expert data-parallel shard group
        # (expert-DP 1), not the dense DP2
        assert sizes == [model_parallel * EXPERT_PARALLEL]

"""The distributed optimizer with two instances and expert parallelism: 4 ranks, EP2, expert-DP 2 split 1 x 2.

Dense buffers are sharded over the two data-parallel ranks of an instance and all-reduced across the instances;
expert buffers are sharded over parallel_state's inner expert data-parallel group (one rank here) and all-reduced
across the instances over its outer expert group. The toy MoE model of `test_expert_data_parallel` must train like
the one-process reference there (losses, grad norms with clipping on, zero counts, final weights within 1e-5), the
expert optimizer state sharded over the inner group only. A torch_dist checkpoint saved there resumes under DDP at
EP1 like the uninterrupted run. Both runs share one call on the ranks.
"""

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.dist_checkpointing import test_expert_resharding as expert_resharding
from tests.unit_tests.distributed import test_expert_data_parallel as expert_training
from tests.unit_tests.distributed.fsdp.test_expert_parallel import _check_history, _check_params
from tests.unit_tests.multiprocess_harness import run_on_ranks

WORLD, EXPERT_PARALLEL, INSTANCES = 4, 2, 2


def _ranks(group):
    return None if group is None else dist.get_process_group_ranks(group)


def _train_then_resume(directory):
    from megatron.core import parallel_state
    from megatron.training.training_log import memory_usage

    run = expert_training.TrainingRun(EXPERT_PARALLEL, "distributed_optimizer",
                                      num_distributed_optimizer_instances=INSTANCES)
    expert_groups, dense_groups = run.ddp.expert_groups, run.ddp.groups
    groups = {
        "expert": [_ranks(group) for group in (expert_groups.data_parallel_group, expert_groups.shard_group,
                                               expert_groups.outer_group)],
        "expected_expert": [_ranks(parallel_state.get_expert_data_parallel_group()),
                            _ranks(parallel_state.get_expert_data_parallel_group(partial_expert_data_parallel=True)),
                            _ranks(parallel_state.get_outer_expert_data_parallel_group())],
        "dense": [_ranks(group) for group in (dense_groups.shard_group, dense_groups.outer_group)],
        "buffers": [buffer.groups is expert_groups for buffer in run.ddp.buffers],
    }
    history = run.train(range(expert_training.STEPS))
    memory = memory_usage([run.ddp], run.optimizer, torch.device("cpu"))
    expert_memory = {key: value for key, value in memory.items() if key.startswith("expert_")}
    params = run.global_parameters()
    parallel_state.destroy_model_parallel()
    resumed = expert_resharding._save_then_resume(directory, (EXPERT_PARALLEL, "distributed_optimizer", INSTANCES),
                                                  (1, "ddp"))
    return groups, expert_memory, history, params, resumed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_on_ranks(WORLD, _train_then_resume, str(tmp_path_factory.mktemp("instances") / "ckpt"))


def test_two_instances_with_expert_parallelism_train_like_one_process(runs):
    expected_history, expected_params = expert_training.uninterrupted_reference()
    assert any(norm > expert_training.CLIP_GRAD for _, norm, _ in expected_history)  # clipping is exercised
    assert any(zeros > 0 for _, _, zeros in expected_history)  # experts without tokens: zero gradients
    expert_bytes = 4 * sum(param.numel() for name, param in expected_params.items() if ".local_experts." in name)
    local = expert_bytes // EXPERT_PARALLEL  # fp32 bytes of one rank's experts
    for rank, (groups, memory, _, _, _) in enumerate(runs):
        # ranks (0, 2) and (1, 3) hold the same experts; instances are ranks {0, 1} and {2, 3}
        expert_peer = rank ^ 2
        assert groups["expert"] == groups["expected_expert"] == [sorted([rank, expert_peer]), [rank],
                                                                 sorted([rank, expert_peer])]
        instance = rank // 2 * 2
        assert groups["dense"] == [[instance, instance + 1], sorted([rank, expert_peer])]
        assert groups["buffers"].count(True) == 1 and groups["buffers"][-1]
        assert memory["expert_params_bytes"] == local and memory["expert_grads_bytes"] == local
        # the inner expert group is this rank alone: Adam's two moments of all its experts (the fp32 weights are
        # the main weights, stepped in place)
        assert memory["expert_optimizer_state_bytes"] == 2 * local
    _, _, history, params, _ = runs[0]
    _check_history(history, expected_history)
    _check_params(params, expected_params)


def test_two_instance_expert_checkpoint_resumes_under_ddp_ep1(runs):
    expected_history, expected_params = expert_training.uninterrupted_reference()
    keys, history, params = runs[0][-1]
    assert {key for key in keys if key.startswith("model.") and ".local_experts." in key} == {
        f"model.{name}" for name in expected_params if ".local_experts." in name}
    assert "optimizer.state.mlp.experts.local_experts.3.linear_fc2.weight.exp_avg_sq" in keys
    _check_history(history, expected_history[expert_resharding.SAVE_AFTER:])
    _check_params(params, expected_params)

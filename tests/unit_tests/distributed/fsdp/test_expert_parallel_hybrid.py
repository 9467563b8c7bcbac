"""Megatron-FSDP HSDP / HFSDP with expert parallelism: 4 ranks, EP2, two distributed-optimizer instances.

Dense parameters are sharded over the two ranks of an instance and all-reduced (HFSDP: reduce-scattered)
across the instances; expert parameters are sharded over the expert data-parallel ranks of an instance (one
here: expert-DP 2 splits 1 x 2) and reduced across the instances over parallel_state's outer expert group. The toy
MoE model of `test_expert_data_parallel` must train like the one-process reference there (losses, grad norms with
clipping on and zero counts per step, final weights within 1e-5) under HSDP ZeRO-1 and ZeRO-3 and HFSDP ZeRO-3,
with the memory line's expert bytes by the sharding theory. The three runs share one call on the ranks, which
also checks the package's errors for an expert mesh that does not fit an HSDP model. A torch_dist checkpoint saved
under HFSDP (expert main weights and Adam state split across the instances) resumes under DDP at EP1 like the
uninterrupted run.
"""

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.dist_checkpointing import test_expert_resharding as expert_resharding
from tests.unit_tests.distributed import test_expert_data_parallel as expert_training
from tests.unit_tests.distributed.fsdp.test_expert_parallel import _check_history, _check_params
from tests.unit_tests.multiprocess_harness import run_on_ranks

WORLD, EXPERT_PARALLEL, INSTANCES = 4, 2, 2
WRAPPERS = ("megatron_fsdp_z1", "megatron_fsdp_z3", "megatron_fsdp_z3_hfsdp")
pytestmark = pytest.mark.world_size(WORLD)  # run with the other tests of this world size, on one pool


def _train_hybrid(wrapper):
    from megatron.core import parallel_state
    from megatron.training.training_log import memory_usage

    run = expert_training.TrainingRun(EXPERT_PARALLEL, wrapper, num_distributed_optimizer_instances=INSTANCES)
    fsdp = run.ddp.fsdp
    expert_topology = fsdp.expert_topology
    # the expert groups' replicas are parallel_state's outer expert group, their shard ranks the inner one
    assert dist.get_process_group_ranks(expert_topology.outer_group) == dist.get_process_group_ranks(
        parallel_state.get_outer_expert_data_parallel_group())
    assert dist.get_process_group_ranks(expert_topology.dp_group) == dist.get_process_group_ranks(
        parallel_state.get_expert_data_parallel_group(partial_expert_data_parallel=True))
    layout = sorted({(group.expert, group.topology.dp_size, group.topology.outer_size, group.outer_sharded)
                     for group in fsdp.groups})
    shard_groups = [dist.get_world_size(group) for group in run.ddp.expert_grad_shard_groups()]
    history = run.train(range(expert_training.STEPS))
    memory = memory_usage([run.ddp], run.optimizer, torch.device("cpu"))
    expert_memory = {key: value for key, value in memory.items() if key.startswith("expert_")}
    return layout, shard_groups, expert_memory, history, run.global_parameters()


def _expert_mesh_errors():
    """MegatronFSDP on parallel_state's HSDP mesh given an expert mesh without the outer dim, and the right expert
    mesh without its hybrid group."""
    import megatron_fsdp

    from megatron.core import parallel_state
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import _expert_device_mesh
    from tests.unit_tests.distributed.expert_toy_model import ToyMoEModel

    parallel_state.initialize_model_parallel(expert_model_parallel_size=EXPERT_PARALLEL,
                                             num_distributed_optimizer_instances=INSTANCES)
    dense = dict(device_mesh=parallel_state.get_device_mesh(), dp_shard_dim="dp_shard_cp", dp_outer_dim="dp_outer",
                 hybrid_fsdp_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    config = megatron_fsdp.DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params",
                                                         num_distributed_optimizer_instances=INSTANCES)
    errors = []
    for expert_mesh in (_expert_device_mesh(False, False), _expert_device_mesh(False, True)):
        model = ToyMoEModel(ep_group=parallel_state.get_expert_model_parallel_group())
        with pytest.raises(ValueError) as error:
            megatron_fsdp.MegatronFSDP(model, config, expt_device_mesh=expert_mesh, **dense)
        errors.append(str(error.value))
    return errors


def _train_every_wrapper():
    from megatron.core import parallel_state

    results = {}
    for wrapper in WRAPPERS:
        results[wrapper] = _train_hybrid(wrapper)
        parallel_state.destroy_model_parallel()
    results["errors"] = _expert_mesh_errors()
    return results


@pytest.fixture(scope="module")
def hybrid_runs():
    return run_on_ranks(WORLD, _train_every_wrapper)


@pytest.mark.parametrize("wrapper", WRAPPERS, ids=["hsdp-z1", "hsdp-z3", "hfsdp-z3"])
def test_hybrid_sharding_with_expert_parallelism_trains_like_one_process(hybrid_runs, wrapper):
    expected_history, expected_params = expert_training.uninterrupted_reference()
    assert any(norm > expert_training.CLIP_GRAD for _, norm, _ in expected_history)  # clipping is exercised
    expert_bytes = 4 * sum(param.numel() for name, param in expected_params.items() if ".local_experts." in name)
    local = expert_bytes // EXPERT_PARALLEL  # fp32 bytes of one rank's experts, whole (one expert-DP rank each)
    hfsdp = wrapper == "megatron_fsdp_z3_hfsdp"
    per_rank = [results[wrapper] for results in hybrid_runs]
    for layout, shard_groups, memory, _, _ in per_rank:
        # dense groups over the 2 ranks of an instance, expert groups over 1; both across the 2 instances
        assert layout == [(False, WORLD // INSTANCES, INSTANCES, hfsdp), (True, 1, INSTANCES, hfsdp)]
        # expert gradient pieces are disjoint across the instances only under HFSDP
        assert shard_groups == ([INSTANCES] if hfsdp else [])
        assert memory["expert_params_bytes"] == local and memory["expert_grads_bytes"] == local
        if not hfsdp:  # fp32 main weights are the weights; Adam's two moments
            assert memory["expert_optimizer_state_bytes"] == 2 * local
    if hfsdp:  # main weights and two moments, split over the two instances holding the same experts
        assert sum(memory["expert_optimizer_state_bytes"] for _, _, memory, _, _ in per_rank) == 3 * expert_bytes
    _, _, _, history, params = per_rank[0]
    _check_history(history, expected_history)
    _check_params(params, expected_params)


def test_expert_mesh_that_does_not_fit_hybrid_sharding_is_named(hybrid_runs):
    without_outer_dim, without_group = hybrid_runs[0]["errors"]
    assert without_outer_dim == ("HSDP / HFSDP with expt_device_mesh: the expert mesh needs dims named like the "
                                 "dense outer and shard dims ('dp_outer', 'dp_shard_cp'), got ('dp_shard_cp',)")
    assert without_group.startswith("HSDP / HFSDP with expt_device_mesh needs expt_hybrid_fsdp_group")


def test_hfsdp_expert_checkpoint_resumes_under_ddp_ep1(tmp_path):
    expected_history, expected_params = expert_training.uninterrupted_reference()
    keys, history, params = run_on_ranks(WORLD, expert_resharding._save_then_resume, str(tmp_path / "ckpt"),
                                         (EXPERT_PARALLEL, "megatron_fsdp_z3_hfsdp", INSTANCES), (1, "ddp"))[0]
    assert {key for key in keys if key.startswith("model.") and ".local_experts." in key} == {
        f"model.{name}" for name in expected_params if ".local_experts." in name}
    assert "optimizer.state.mlp.experts.local_experts.3.linear_fc2.weight.exp_avg_sq" in keys
    _check_history(history, expected_history[expert_resharding.SAVE_AFTER:])
    _check_params(params, expected_params)

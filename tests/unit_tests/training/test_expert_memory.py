"""The experts' part of the memory line under `--optimizer-cpu-offload`: the host gradients and host copies of
offloaded expert main parameters count there as they do in the line's totals."""

import torch
import torch.distributed as dist

from tests.unit_tests.multiprocess_harness import run_on_ranks


def _expert_memory_after_a_step(cpu_offload):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.training.training_log import memory_usage
    from tests.unit_tests.distributed.expert_toy_model import ToyMoEModel, mse_loss, toy_batch

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    model = ToyMoEModel(ep_group=parallel_state.get_expert_model_parallel_group())
    chunk = DistributedDataParallel(ModelParallelConfig(expert_model_parallel_size=2),
                                    DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        lr=0.01, use_distributed_optimizer=True, use_precision_aware_optimizer=cpu_offload,
        optimizer_cpu_offload=cpu_offload, optimizer_offload_fraction=1.0), [chunk])
    inputs, targets = toy_batch(0, 4)
    rows = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    mse_loss(chunk, inputs[rows], targets[rows]).backward()
    finalize_model_grads([chunk])
    optimizer.step()
    memory = memory_usage([chunk], optimizer, torch.device("cpu"))
    return {key: value for key, value in memory.items() if key.startswith("expert_")}


def _with_and_without_offload():
    return _expert_memory_after_a_step(False), _expert_memory_after_a_step(True)


def test_offloaded_expert_main_parameters_count_their_host_gradients_and_copies():
    """EP2 on two ranks: each rank's experts are its own (expert-DP 1), all offloaded (fraction 1.0, fp32): the
    host gradient adds the experts' parameter bytes to their grads, the host copy of the main parameters (the
    device keeps the fp32 weights they view) to their optimizer state, beside the two moments."""
    for plain, offloaded in run_on_ranks(2, _with_and_without_offload):
        expert_bytes = plain["expert_params_bytes"]
        assert expert_bytes > 0 and offloaded["expert_params_bytes"] == expert_bytes
        assert plain["expert_grads_bytes"] == expert_bytes and plain["expert_optimizer_state_bytes"] == 2 * expert_bytes
        assert offloaded["expert_grads_bytes"] == 2 * expert_bytes
        assert offloaded["expert_optimizer_state_bytes"] == 3 * expert_bytes

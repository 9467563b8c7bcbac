"""The memory line under `--fp8-format hybrid --fp8-param-gather`: the FP8 bytes and scales of the weights of FP8
layers are compute weights (upstream's FP8 parameters), counted in `params_bytes`, so params + grads + optimizer
state still equal the storages the rank holds, with the distributed optimizer and with Megatron-FSDP ZeRO-3; and
under Megatron-FSDP ZeRO-3 at EP2 the experts' part of the line counts the FP8 wire shards of expert weights."""

import pytest
import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.training.test_memory_line_storages import TOLERANCE, held_storage_bytes

WRAPPERS = {
    "distributed_optimizer": dict(use_distributed_optimizer=True),
    "megatron_fsdp_z3": dict(use_megatron_fsdp=True, use_distributed_optimizer=True,
                             data_parallel_sharding_strategy="optim_grads_params"),
}


def _fp8_gpt(num_experts=None):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tests.unit_tests.distributed.precision_gpt import HEADS, HIDDEN, SEED, SEQ, VOCAB

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2 if num_experts else 1)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    moe = dict(num_moe_experts=num_experts, moe_ffn_hidden_size=HIDDEN,
               expert_model_parallel_size=2) if num_experts else {}
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0, attention_dropout=0.0,
        init_seed=SEED, bf16=True, params_dtype=torch.bfloat16, fp8="hybrid", fp8_param=True, **moe,
    )
    return GPTModel(config, get_gpt_layer_local_spec(num_experts=num_experts), vocab_size=VOCAB,
                    max_sequence_length=SEQ)


def _trained_line(wrapper, num_experts=None):
    from megatron.core.distributed import DistributedDataParallelConfig, wrap_data_parallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.training.training_log import memory_usage
    from tests.unit_tests.distributed.precision_gpt import gpt_batch, gpt_loss

    model = _fp8_gpt(num_experts)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, fp8_param_gather=True, **WRAPPERS[wrapper])
    chunk = wrap_data_parallel(model.config, ddp_config, model)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True, use_distributed_optimizer=True), [chunk])
    chunk.zero_grad_buffer()
    optimizer.zero_grad()
    gpt_loss(chunk, gpt_batch(0)).backward()
    chunk.finish_grad_sync()
    assert optimizer.step()[0]
    return chunk, optimizer, memory_usage([chunk], optimizer, torch.device("cpu"))


def _line_versus_storages():
    results = {}
    for wrapper in WRAPPERS:
        chunk, optimizer, line = _trained_line(wrapper)
        results[wrapper] = {"reported": line["params_bytes"] + line["grads_bytes"] + line["optimizer_state_bytes"],
                            "held": held_storage_bytes(chunk, optimizer), "line": line}
    return results


def _expert_line_versus_expert_group_storages():
    """The experts' part of the line, and the storages of the Megatron-FSDP groups holding only expert
    parameters (their buffers and shards, and the optimizer's state of their main weights)."""
    from megatron.core.expert_parameters import is_expert_parameter

    chunk, optimizer, line = _trained_line("megatron_fsdp_z3", num_experts=4)
    groups = [group for group in chunk.fsdp.groups if all(is_expert_parameter(param) for param in group.params)]
    assert groups and any(group.wire_shard is not None for group in groups)
    buffers = [value for group in groups for value in vars(group).values() if torch.is_tensor(value)]
    states = [optimizer.optimizer.state.get(main, {}) for group in groups for main in group.main_param_views]
    reported = line["expert_params_bytes"] + line["expert_grads_bytes"] + line["expert_optimizer_state_bytes"]
    return reported, held_storage_bytes(*buffers, *states)


@pytest.fixture(scope="module")
def measured():
    return run_on_ranks(2, _line_versus_storages)


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_fp8_weight_copies_are_counted_as_params(measured, wrapper):
    for rank, results in enumerate(measured):
        result = results[wrapper]
        held, reported = result["held"], result["reported"]
        assert abs(reported - held) <= TOLERANCE * held, (rank, wrapper, result)


def test_fp8_wire_shards_of_expert_weights_are_counted_as_expert_params():
    for rank, (reported, held) in enumerate(run_on_ranks(2, _expert_line_versus_expert_group_storages)):
        assert abs(reported - held) <= TOLERANCE * held, (rank, reported, held)

"""Transfers between two pipeline stages carry exact values, in the right shapes, dtypes and grad modes."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import p2p_communication
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.pipeline_parallel.toy_stages import ToyConfig

SHAPE = (3, 2, 4)


def _activation(microbatch):
    return torch.arange(24, dtype=torch.float32).reshape(SHAPE) + 100.0 * microbatch


def _gradient(microbatch):
    return -torch.arange(24, dtype=torch.float32).reshape(SHAPE) - 100.0 * microbatch


def _exchange_between_two_stages():
    """Stage 0 plays a first stage, stage 1 a last stage, through every function of the module."""
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    config = ToyConfig(hidden_size=SHAPE[2])
    stage = parallel_state.get_pipeline_model_parallel_rank()
    seen = {}
    if stage == 0:
        assert p2p_communication.recv_forward(SHAPE, config) is None  # nothing before the first stage
        p2p_communication.send_forward(_activation(0), config)
        grad = p2p_communication.send_forward_recv_backward(_activation(1), SHAPE, config)
        seen["grad_0"] = grad
        seen["grad_1"] = p2p_communication.recv_backward(SHAPE, config)
        assert p2p_communication.send_backward_recv_forward(torch.ones(SHAPE), SHAPE, config) is None
    else:
        assert p2p_communication.recv_backward(SHAPE, config) is None  # nothing after the last stage
        seen["act_0"] = p2p_communication.recv_forward(SHAPE, config)
        # Stage 0 sends microbatch 1 while waiting for the gradient of microbatch 0.
        seen["act_1"] = p2p_communication.send_backward_recv_forward(_gradient(0), SHAPE, config)
        p2p_communication.send_backward(_gradient(1), config)
        assert p2p_communication.send_forward_recv_backward(torch.ones(SHAPE), SHAPE, config) is None
    return {name: (t.tolist(), t.requires_grad, t.is_leaf, str(t.dtype)) for name, t in seen.items()}


@pytest.mark.parametrize("world_size", [2])
def test_activations_and_gradients_arrive_exactly(world_size):
    first, last = run_on_ranks(world_size, _exchange_between_two_stages)
    for microbatch in (0, 1):
        values, requires_grad, is_leaf, dtype = last[f"act_{microbatch}"]
        assert values == _activation(microbatch).tolist()
        assert requires_grad and is_leaf and dtype == "torch.float32"  # the receiver differentiates w.r.t. it
        values, requires_grad, _, _ = first[f"grad_{microbatch}"]
        assert values == _gradient(microbatch).tolist()
        assert not requires_grad


def _bf16_exchange_and_wrong_dtype():
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    config = ToyConfig(hidden_size=SHAPE[2], pipeline_dtype=torch.bfloat16)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    if stage == 0:
        with pytest.raises(TypeError, match="pipeline_dtype"):
            p2p_communication.send_forward(_activation(0), config, SHAPE)  # fp32 on a bf16 pipeline
        with pytest.raises(ValueError, match="expects"):
            p2p_communication.send_forward(torch.zeros(2, 2, 4, dtype=torch.bfloat16), config, SHAPE)
        p2p_communication.send_forward(_activation(0).bfloat16(), config, SHAPE)
        return None
    received = p2p_communication.recv_forward(SHAPE, config)
    return str(received.dtype), received.float().tolist()


@pytest.mark.parametrize("world_size", [2])
def test_pipeline_dtype_is_used_and_mismatches_are_rejected_before_sending(world_size):
    _, (dtype, values) = run_on_ranks(world_size, _bf16_exchange_and_wrong_dtype)
    assert dtype == "torch.bfloat16"
    assert values == _activation(0).bfloat16().float().tolist()


def _activation_shapes(tensor_parallel_size):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)
    shapes = []
    for sequence_parallel in (False, True):
        config = ToyConfig(hidden_size=16, sequence_parallel=sequence_parallel)
        shapes.append(p2p_communication.activation_shape(seq_length=8, micro_batch_size=3, config=config))
    with pytest.raises(ValueError, match="divisible"):
        p2p_communication.activation_shape(seq_length=7, micro_batch_size=3, config=ToyConfig(sequence_parallel=True))
    return shapes


@pytest.mark.parametrize("world_size", [2])
def test_activation_shape_splits_sequence_with_sequence_parallel(world_size):
    results = run_on_ranks(world_size, _activation_shapes, 2)
    assert results == [[(8, 3, 16), (4, 3, 16)]] * 2


def test_activation_shape_needs_hidden_size():
    with pytest.raises(ValueError, match="hidden_size"):
        p2p_communication.activation_shape(seq_length=8, micro_batch_size=1, config=None)

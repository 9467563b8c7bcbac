"""A unit's gradients reach the persistent gradient buffer of strategies 0/1 in one batch after the unit's
backward (grad_buffers.py `take_accumulated_grads`, schedule.py `_add_accumulated_grads`), with the same result as
the per-parameter write of a root group's hook (`write_grad`).

The layout checks build groups directly (no processes), at DP 2 and 3 so that one parameter is padded; the
training check is the toy MoE model of `test_expert_data_parallel` on 2 ranks, whose training under strategy 1 is
held to the one-process reference by `test_expert_parallel.py`.
"""

import pytest
import torch
import torch.nn as nn

from tests.unit_tests.distributed import test_expert_data_parallel as expert_training
from tests.unit_tests.multiprocess_harness import run_on_ranks

SHAPES = [(6, 5), (5,), (4, 3)]  # 30 and 12 elements split evenly over 2 and 3 ranks; 5 does not
SCALE = 0.5


def _group(strategy, dp_size, dp_rank):
    from megatron_fsdp.distributed_data_parallel_config import ShardingStrategy
    from megatron_fsdp.mixed_precision import MixedPrecisionPolicy
    from megatron_fsdp.param_and_grad_buffer import ParamGroup

    params = [nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    return ParamGroup(params, [f"p{i}" for i in range(len(SHAPES))], strategy=ShardingStrategy[strategy],
                      dp_rank=dp_rank, dp_size=dp_size, device=torch.device("cpu"), policy=MixedPrecisionPolicy(),
                      unit_index=0)


def _microbatch_grads(microbatch, dtype=torch.float32):
    generator = torch.Generator().manual_seed(100 + microbatch)
    return [torch.randn(shape, generator=generator).to(dtype) for shape in SHAPES]


def _unsharded(group):
    """The group's gradient buffer in param-major form, one tensor per parameter."""
    from megatron_fsdp.distributed_data_parallel_config import ShardingStrategy
    from megatron_fsdp.resharding import copy_gathered_to_unsharded

    flat = group.grad_buffer
    if group.strategy != ShardingStrategy.no_shard:  # rank-major: every rank's rows, back in parameter order
        flat = torch.empty_like(group.grad_buffer)
        copy_gathered_to_unsharded(group.layout, group.grad_buffer, flat)
    return [flat[span.flat_start:span.flat_end].view(shape) for span, shape in zip(group.layout.spans, SHAPES)]


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
@pytest.mark.parametrize("dp_size", [2, 3])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_a_units_batched_gradients_add_up_as_the_per_parameter_writes_do(strategy, dp_size, grad_dtype):
    from megatron_fsdp.grad_state import GradState

    one_by_one, batched = _group(strategy, dp_size, dp_rank=1), _group(strategy, dp_size, dp_rank=1)
    assert one_by_one.grad_buffer is not None  # strategies 0/1: a persistent buffer, added to across microbatches
    expected = [torch.zeros(shape) for shape in SHAPES]
    for microbatch in range(2):  # two microbatches accumulated (no_sync)
        grads = _microbatch_grads(microbatch, grad_dtype)
        for index, grad in enumerate(grads):
            one_by_one.write_grad(index, grad, SCALE)
            expected[index] += grad.float() * SCALE
        if microbatch == 0:  # parameter 1's gradient arrives after its unit's backward (the end-of-backward batch)
            batched.take_accumulated_grads([0, 2], [grads[0], grads[2]], SCALE)
            batched.take_accumulated_grads([1], [grads[1]], SCALE)
        else:
            batched.take_accumulated_grads([0, 1, 2], grads, SCALE)
    for got, want, reference in zip(_unsharded(batched), _unsharded(one_by_one), expected):
        assert got.dtype == torch.float32
        assert torch.equal(got, want)
        torch.testing.assert_close(got, reference, rtol=1e-6, atol=1e-6)

    # a reduction of this step already took the buffer: more gradients reopen it the same way in both paths
    for group in (one_by_one, batched):
        group.move_grads_to(GradState.REDUCED)
    grads = _microbatch_grads(2, grad_dtype)
    for index, grad in enumerate(grads):
        one_by_one.write_grad(index, grad, SCALE)
    batched.take_accumulated_grads([0, 1, 2], grads, SCALE)
    assert batched.grad_state is GradState.ACCUMULATING
    for got, want in zip(_unsharded(batched), _unsharded(one_by_one)):
        assert torch.equal(got, want)


def _hooks_and_batches(wrapper):
    run = expert_training.TrainingRun(2, wrapper)
    fsdp = run.ddp.fsdp
    batches = []
    for group in fsdp.groups:
        take = group.take_accumulated_grads

        def recorded(indices, grads, scale, group=group, take=take):
            take(indices, grads, scale)
            batches.append((group.unit_index, len(indices), len(group.params)))
        group.take_accumulated_grads = recorded
    run.train(range(2))
    root_params = sum(len(group.params) for group in fsdp.groups if group.unit_index is None and group.trainable)
    return {
        "hooks": len(fsdp.schedule.hook_handles),
        "expected_hooks": root_params + 2 * len(fsdp.schedule.units),  # plus a forward pre/post hook per unit
        "batches": batches,
        "units": len(fsdp.schedule.units),
        "persistent": all(group.grad_buffer is not None for group in fsdp.groups
                          if group.unit_index is not None and not group.grads_into_main),
    }


@pytest.mark.parametrize("wrapper", ["megatron_fsdp_z1"])
def test_strategy_1_units_take_their_gradients_in_one_batch_per_microbatch(wrapper):
    for result in run_on_ranks(2, _hooks_and_batches, wrapper):
        assert result["persistent"]
        assert result["hooks"] == result["expected_hooks"]  # no gradient hook on any unit parameter
        unit_batches = [entry for entry in result["batches"] if entry[0] is not None]
        assert len({unit for unit, _, _ in unit_batches}) == result["units"]
        assert all(taken == held for _, taken, held in unit_batches)  # every parameter of the group at once

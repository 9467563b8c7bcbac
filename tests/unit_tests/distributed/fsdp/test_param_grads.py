"""`.grad` of the module's parameters after the last microbatch's backward: this rank's part of the reduced
gradient, for every strategy (a Replicate() DTensor of the whole gradient under no_shard, Shard(0) rows
otherwise), viewing the gradients the optimizer steps with, so in-place changes reach the step; none after the
microbatches run under no_sync; `zero_grad()` resets it. Also: `copy.deepcopy` of a wrapped model refuses with a
clear error. (Every strategy x outer strategy against the rules: test_grad_contract.py.)"""

import copy

import pytest
import torch

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

MICROBATCHES = 2
LR = 0.1
GRAD_FACTOR = 0.5  # applied in place to every p.grad before the step
STEPS = 2  # the second step's .grad must view that step's reduced gradient, not the first one's


def _reference():
    """Single process: per step, the full-batch gradients; and SGD's weights after STEPS steps, each on
    GRAD_FACTOR * the gradients."""
    model = models.make_model(0)
    params = dict(model.named_parameters())
    grads_per_step = []
    for inputs, target in models.make_batches(STEPS):
        model.zero_grad()
        models.loss_fn(model(inputs), target).backward()
        grads_per_step.append({name: p.grad.clone() for name, p in params.items() if p.grad is not None})
        with torch.no_grad():
            for p in params.values():
                if p.grad is not None:
                    p.sub_(LR * GRAD_FACTOR * p.grad)
    return grads_per_step, {name: p.detach().clone() for name, p in params.items()}


def _grads_by_strategy():
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import megatron_fsdp
    from megatron_fsdp.layout import chunk_rows

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [tuple(models.local_slice(t, rank, world) for t in batch) for batch in models.make_batches(STEPS)]
    results = {}
    for strategy in range(4):
        module = models.make_model(0)
        optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=LR)
        model, optimizer = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[models.Block],
                                                     zero_dp_strategy=strategy)
        kinds, grads_per_step, rows_ok, after_first, reset = set(), [], True, None, True
        for inputs, target in batches:
            optimizer.zero_grad()
            chunk = inputs.shape[0] // MICROBATCHES
            for micro in range(MICROBATCHES):
                part = slice(micro * chunk, (micro + 1) * chunk)
                with (model.no_sync() if micro < MICROBATCHES - 1 else models._null()):
                    (models.loss_fn(model(inputs[part]), target[part]) / MICROBATCHES).backward()
                if after_first is None:  # a microbatch under no_sync: its sums are not final, nothing shows
                    after_first = [p.grad is not None for p in model.parameters() if p.requires_grad]
            grads = {}
            for name, p in model.module.named_parameters():
                if p.grad is None:
                    continue
                grad = p.grad
                if isinstance(grad, DTensor):
                    kinds.add(("DTensor", tuple(grad.placements), tuple(grad.shape) == tuple(p.shape)))
                    start, end = chunk_rows(p.shape[0], world, rank) if strategy else (0, p.shape[0])
                    rows_ok &= grad.to_local().shape[0] == end - start
                    grads[name] = grad.full_tensor().clone()
                else:
                    kinds.add(("Tensor", (), tuple(grad.shape) == tuple(p.shape)))
                    grads[name] = grad.clone()
            grads_per_step.append(grads)
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(GRAD_FACTOR)  # must reach the step
            optimizer.step()
        weights = models.full_params(model)
        optimizer.zero_grad()
        reset = all(p.grad is None for p in model.module.parameters())
        results[strategy] = (after_first, kinds, rows_ok, grads_per_step, weights, reset)
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_param_grads_are_this_ranks_part_of_the_reduced_gradient(world_size):
    from torch.distributed.tensor import Replicate, Shard

    reference_grads_per_step, reference_weights = _reference()
    for results in run_on_ranks(world_size, _grads_by_strategy):
        for strategy, (after_first, kinds, rows_ok, grads_per_step, weights, reset) in results.items():
            assert not any(after_first), strategy
            expected_kind = ("DTensor", (Replicate() if strategy == 0 else Shard(0),), True)
            assert kinds == {expected_kind}, (strategy, kinds)
            assert rows_ok, strategy
            assert len(grads_per_step) == STEPS, strategy
            for step, (grads, reference_grads) in enumerate(zip(grads_per_step, reference_grads_per_step)):
                assert set(grads) == set(reference_grads), (strategy, step)
                for name, grad in reference_grads.items():
                    torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6,
                                               msg=f"strategy {strategy} step {step} {name}")
            for name, value in reference_weights.items():
                torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=f"{strategy} {name}")
            assert reset, strategy


def _bf16_grads(strategy):
    import megatron_fsdp

    module = models.make_model(0, torch.bfloat16)
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=LR)
    model, optimizer = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[models.Block],
                                                 zero_dp_strategy=strategy)
    inputs, target = models.make_batches(1, dtype=torch.bfloat16)[0]
    models.loss_fn(model(inputs), target).backward()
    model.finish_grad_sync()
    # The fp32 reduced gradients are shown as they are (grad_dtype), on the very storage the optimizer reads.
    dtypes, shared = set(), True
    for p in model.parameters():
        if p.grad is None:
            continue
        dtypes.add((p.dtype, p.grad.dtype))
        group, index = model.param_to_group[id(p)]
        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        shared &= local.numel() == 0 or local.data_ptr() == group.optimizer_grad_views()[index].data_ptr()
    optimizer.zero_grad()
    restored = all(getattr(p, "grad_dtype", p.dtype) == p.dtype for p in model.parameters())
    return dtypes, shared, restored


@pytest.mark.parametrize("world_size", [2])
def test_bf16_model_shows_its_fp32_gradients(world_size):
    for strategy in (1, 3):
        for dtypes, shared, restored in run_on_ranks(world_size, _bf16_grads, strategy):
            assert dtypes == {(torch.bfloat16, torch.float32)}, (strategy, dtypes)
            assert shared and restored, strategy


def _deepcopy_refuses():
    import megatron_fsdp

    model = megatron_fsdp.fully_shard_model(models.make_model(0), fsdp_unit_modules=[models.Block])
    messages = []
    for target in (model, model.module):
        try:
            copy.deepcopy(target)
            messages.append(None)
        except TypeError as error:
            messages.append(str(error))
    return messages


@pytest.mark.parametrize("world_size", [2])
def test_deepcopy_of_a_wrapped_model_says_what_to_do_instead(world_size):
    for messages in run_on_ranks(world_size, _deepcopy_refuses):
        for message in messages:
            assert message is not None and "load_state_dict(model.state_dict())" in message, message


def _hybrid_grads(outer_strategy):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import megatron_fsdp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    module = models.make_model(0)
    model = megatron_fsdp.fully_shard_model(
        module, device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
        hybrid_fsdp_group=mesh._flatten("dp_outer_shard").get_group(), outer_dp_sharding_strategy=outer_strategy,
        fsdp_unit_modules=[models.Block], zero_dp_strategy=3)
    inputs, target = (models.local_slice(t, dist.get_rank(), dist.get_world_size()) for t in models.make_batches(1)[0])
    models.loss_fn(model(inputs), target).backward()
    before_sync = [p.grad is not None for p in model.parameters() if p.requires_grad]
    model.finish_grad_sync()
    grads = {name: p.grad.full_tensor().clone() for name, p in model.module.named_parameters() if p.grad is not None}
    return before_sync, grads


@pytest.mark.parametrize("world_size", [4])
def test_hybrid_sharding_grads_after_finish_grad_sync(world_size):
    """HSDP and HFSDP: the synchronised backward completes the outer reductions too, so `.grad` shows the
    reduced gradients right after it, and again after finish_grad_sync (HFSDP: Partial() over the outer ranks,
    whose sum full_tensor() takes)."""
    reference_grads = _reference()[0][0]  # the first step's
    for outer_strategy in ("no_shard", "optim"):
        for before_sync, grads in run_on_ranks(world_size, _hybrid_grads, outer_strategy):
            assert before_sync and all(before_sync), outer_strategy
            assert set(grads) == set(reference_grads), outer_strategy
            for name, grad in reference_grads.items():
                torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=f"{outer_strategy} {name}")

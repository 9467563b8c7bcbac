"""Accounting (bytes held, bytes sent), HSDP, grad clipping, per-token loss scaling and bad inputs."""

import math

import pytest
import torch
import torch.nn as nn

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks


def _blocks_only(num_blocks=4):
    torch.manual_seed(0)
    return nn.Sequential(*[models.Block() for _ in range(num_blocks)])


def _live_storages() -> dict:
    """data_ptr -> storage of every live, non-empty tensor storage in this process (found by the garbage
    collector, so independent of what Megatron-FSDP thinks it holds)."""
    import gc
    import warnings

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    gc.collect()
    found, mesh_ranks = {}, set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on deprecated torch aliases warns
        for obj in gc.get_objects():
            if isinstance(obj, DeviceMesh):  # its tensor of rank ids is no training state
                mesh_ranks.add(obj.mesh.untyped_storage().data_ptr())
            # DTensors are wrappers without storage of their own; the collector finds their local tensors
            if isinstance(obj, torch.Tensor) and not obj.is_meta and not isinstance(obj, DTensor):
                storage = obj.untyped_storage()
                if storage.nbytes():
                    found[storage.data_ptr()] = storage
    return {ptr: storage for ptr, storage in found.items() if ptr not in mesh_ranks}


def _settled_new_bytes(before: dict) -> int:
    """Bytes of the live storages not in `before`, measured until two measurements 10 ms apart agree: a
    measurement taken at once sometimes still sees a small tensor that is gone 50 ms later (96 bytes here, the
    size of the per-step all-reduce of the ungraded-parameter marks, whose reference gloo's worker thread may drop
    just after waking the waiter)."""
    import time

    previous = None
    for _ in range(50):
        measured = sum(storage.nbytes() for ptr, storage in _live_storages().items() if ptr not in before)
        if measured == previous:
            return measured
        previous = measured
        time.sleep(0.01)
    raise AssertionError(f"the live storages did not settle within 0.5 s (last {previous} bytes)")


def _accounting():
    """Per-rank bytes and bytes sent per step for each strategy on a model made only of units, and the bytes of
    the tensor storages that wrapping and training created (measured) next to what memory_report() says."""
    import torch.distributed as dist

    import megatron_fsdp

    world = dist.get_world_size()
    results = {}
    for strategy in range(4):
        module = _blocks_only()
        numel = sum(p.numel() for p in module.parameters())
        optimizer = models.make_optimizer(module.parameters())
        inputs = torch.randn(4, models.HIDDEN)
        before = _live_storages()  # held alive here, so no new storage can reuse their addresses
        model, optimizer = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[models.Block],
                                                     zero_dp_strategy=strategy)
        # ZeRO's theory of what is held: each reduction and gather issued on its own (this model's groups are
        # small enough for the schedule to hold them and reduce them together, see test_coalesced_reductions.py,
        # and to gather several units ahead in one exchange)
        model.schedule.coalesce_reduce_bytes = 0
        model.schedule.coalesce_gather_bytes = 0  # and each gather (test_coalesced_gathers.py)
        padded = sum(group.layout.padded_numel for group in model.groups)
        # The row-aligned layout's theory: each parameter's chunk is ceil(rows / world) rows on every rank
        # (no_shard pads nothing).
        theory_shard = sum(math.ceil(p.shape[0] / world) * p[0].numel() for p in module.parameters())
        assert padded == (numel if strategy == 0 else world * theory_shard), (padded, theory_shard)
        for _ in range(2):
            optimizer.zero_grad()
            model(inputs).square().mean().backward()
            optimizer.step()
        if strategy in (1, 2):  # the last post-step gathers still queued behind the window of two start now
            with model.gathered_parameters():
                pass
        measured = _settled_new_bytes(before)
        del before
        owned = sum(piece.numel for group in model.groups for piece in group.pieces)  # this rank's rows
        last_unit = sum(group.layout.padded_numel for group in model.schedule.units[-1].groups)
        results[strategy] = (numel, padded, owned, model.memory_report(), model.communication_report(), measured,
                             last_unit)
    return results


@pytest.mark.parametrize("world_size", [3])
def test_bytes_held_and_sent_match_zero_theory(world_size):
    results = run_on_ranks(world_size, _accounting)
    for rank_results in results:
        for strategy, (numel, padded, owned, memory, comm, measured, last_unit) in rank_results.items():
            # the storages this rank really holds after a step are exactly the ones the report counts
            assert measured == memory["total_persistent"] + memory["transient_now"], (strategy, measured, memory)
            # Adam's moments cover this rank's rows, not the padding of its shard
            full, shard, rows = 4 * padded, 4 * padded // world_size, 4 * owned
            expected = {
                0: dict(compute_weights=full, main_weights=0, grads=full, optimizer_state=2 * full),
                1: dict(compute_weights=full, main_weights=0, grads=full, optimizer_state=2 * rows),
                2: dict(compute_weights=full, main_weights=0, grads=shard, optimizer_state=2 * rows),
                3: dict(compute_weights=0, main_weights=shard, grads=shard, optimizer_state=2 * rows),
            }[strategy]
            # main weights alias the compute buffer (strategies 0-2: this rank's rows of it under 1/2) or are the
            # sharded compute weights (3)
            for kind, value in expected.items():
                # Adam's step counters are 4-byte scalars, one per parameter
                extra = 4 * 6 * 4 if kind == "optimizer_state" else 0
                assert memory[kind] == value + extra, (strategy, kind)
            if strategy == 3:
                # 16 bytes per padded element over the ranks (this tiny model pads 13- and 7-row weights to 15
                # and 9 rows at world 3: 22% more than its 216 elements per block)
                assert memory["total_persistent"] == 2 * shard + 2 * rows + 4 * 6 * 4
                assert memory["transient_now"] == 0
                assert 0 < memory["transient_peak"] <= 2 * 2 * max(4 * g for g in [padded // 4])
            # per step: strategy 3 gathers twice and reduce-scatters once, except the last unit, which stays
            # gathered from its forward to its backward (gathered once); 0-2 move 2x params (padded elements)
            sent = sum(comm[k] for k in ("all_gather", "reduce_scatter", "all_reduce")) / comm["steps"]
            assert comm["steps"] == 2
            moved = 3 * padded - last_unit if strategy == 3 else 2 * padded
            assert 0 < last_unit < padded
            exact = 4 * moved * (world_size - 1) / world_size
            assert sent == pytest.approx(exact, rel=1e-6)


def _grads_after_backward(per_token, average):
    """Full gradients after one backward under different loss-scaling modes (SGD-free: read main grads)."""
    import torch.distributed as dist

    import megatron_fsdp
    from megatron_fsdp.state_dict import _full_flat

    model = megatron_fsdp.fully_shard_model(models.make_model(0), fsdp_unit_modules=[models.Block],
                                            calculate_per_token_loss=per_token, average_in_collective=average)
    inputs, target = (models.local_slice(t, dist.get_rank(), dist.get_world_size()) for t in models.make_batches(1)[0])
    models.loss_fn(model(inputs), target).backward()
    model.finish_grad_sync()
    grads = {}
    for group in model.groups:
        if group.trainable:
            full = _full_flat(model, group, group.optimizer_grad_views())
            for name, span in zip(group.names, group.layout.spans):
                grads[name] = full[span.flat_start:span.flat_end].view(span.shape).clone()
    return grads


def _clip(max_norm):
    import megatron_fsdp

    module = models.make_model(0)
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.1)
    model, optimizer = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[models.Block])
    import torch.distributed as dist

    inputs, target = (models.local_slice(t, dist.get_rank(), dist.get_world_size()) for t in models.make_batches(1)[0])
    models.loss_fn(model(inputs), target).backward()
    norm = megatron_fsdp.clip_grad_norm_(optimizer, max_norm)
    optimizer.step()
    return norm.item(), {k: v for k, v in models.full_params(model).items()}


@pytest.mark.parametrize("world_size", [2])
def test_loss_scaling_modes_and_clipping(world_size):
    model = models.make_model(0)
    inputs, target = models.make_batches(1)[0]
    models.loss_fn(model(inputs), target).backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    for per_token, average, factor in ((False, False, 1.0), (False, True, 1.0), (True, False, world_size)):
        grads = run_on_ranks(world_size, _grads_after_backward, per_token, average)[0]
        assert set(grads) == set(reference)
        for name, grad in grads.items():
            # per-token losses are summed, not averaged, over data-parallel ranks
            torch.testing.assert_close(grad, factor * reference[name], atol=1e-6, rtol=1e-5, msg=name)
    total_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 0.05)
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1).step()
    norm, params = run_on_ranks(world_size, _clip, 0.05)[0]
    assert norm == pytest.approx(total_norm.item(), rel=1e-5)
    reference_params = dict(model.named_parameters(remove_duplicate=False))  # the state dict has tied aliases
    assert set(params) == set(reference_params)
    for name, value in params.items():
        torch.testing.assert_close(value, reference_params[name].detach(), atol=1e-6, rtol=1e-5)


def _scaled_gradients_per_strategy(scale_factor):
    """Plain SGD (its update is proportional to the gradient scale) under each strategy with both overlaps on:
    `scale_gradients` right after backward, while the last reduction may still be in flight, and after an explicit
    `finish_grad_sync`, against scaling the loss; and the run with neither, which the scaling must change."""
    import megatron_fsdp

    def wrapped(strategy):
        module = models.make_model(0)
        optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.1)
        return megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[models.Block],
                                         zero_dp_strategy=strategy, overlap_grad_reduce=True, overlap_param_gather=True)

    results = {}
    for strategy in range(4):
        results[(strategy, "unscaled")] = models.train_with_gradient_scaling(*wrapped(strategy), 3, 1.0, None, False)
        results[(strategy, "scaled_loss")] = models.train_with_gradient_scaling(*wrapped(strategy), 3, scale_factor,
                                                                                None, False)
        for scale_after_sync in (False, True):
            results[(strategy, scale_after_sync)] = models.train_with_gradient_scaling(
                *wrapped(strategy), 3, 1.0, scale_factor, scale_after_sync)
    return results


@pytest.mark.parametrize("world_size", [2])
def test_scale_gradients_equals_scaling_the_loss(world_size):
    results = run_on_ranks(world_size, _scaled_gradients_per_strategy, 0.3)[0]
    for strategy in range(4):
        expected = results[(strategy, "scaled_loss")]
        assert max(abs(a - b) for a, b in zip(expected, results[(strategy, "unscaled")])) > 1e-3
        for scale_after_sync in (False, True):
            assert results[(strategy, scale_after_sync)] == pytest.approx(expected, abs=1e-6), (strategy,
                                                                                              scale_after_sync)


def _hsdp(strategy):
    from torch.distributed.device_mesh import init_device_mesh

    import megatron_fsdp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    hybrid_group = mesh._flatten("dp_outer_shard").get_group()
    module = models.make_model(0)
    optimizer = models.make_optimizer([p for p in module.parameters() if p.requires_grad])
    model, optimizer = megatron_fsdp.fully_shard(module, optimizer, device_mesh=mesh, dp_shard_dim="dp_shard",
                                                 dp_outer_dim="dp_outer", hybrid_fsdp_group=hybrid_group,
                                                 fsdp_unit_modules=[models.Block], zero_dp_strategy=strategy)
    assert model.topology.dp_size == 2 and model.topology.outer_size == 2
    return models.train_sharded(model, optimizer, 3)


@pytest.mark.parametrize("world_size", [4])
def test_hsdp_matches_single_process(world_size):
    reference, _ = models.reference_losses(3)
    for strategy in (3, 1):
        assert run_on_ranks(world_size, _hsdp, strategy)[0] == pytest.approx(reference, abs=1e-5)


def _bad_inputs():
    import megatron_fsdp
    from megatron_fsdp import MixedPrecisionPolicy

    errors = {}

    def capture(key, fn):
        try:
            fn()
        except (ValueError, TypeError, RuntimeError, NotImplementedError) as error:
            errors[key] = f"{type(error).__name__}: {error}"

    capture("strategy", lambda: megatron_fsdp.fully_shard_model(models.make_model(), zero_dp_strategy="zero9"))
    capture("strategy_int", lambda: megatron_fsdp.fully_shard_model(models.make_model(), zero_dp_strategy=7))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    capture("mesh_dim", lambda: megatron_fsdp.fully_shard_model(models.make_model(), device_mesh=mesh,
                                                                dp_shard_dim="data"))
    capture("outer_without_group", lambda: megatron_fsdp.fully_shard_model(
        models.make_model(), device_mesh=mesh, dp_shard_dim="dp", dp_outer_dim="dp"))
    wrapped = megatron_fsdp.fully_shard_model(models.make_model(), zero_dp_strategy=2)
    capture("wrap_twice", lambda: megatron_fsdp.fully_shard_model(wrapped.module))
    capture("wrap_wrapper", lambda: megatron_fsdp.fully_shard_model(wrapped))
    capture("foreign_optimizer", lambda: megatron_fsdp.fully_shard_optimizer(
        torch.optim.AdamW(models.make_model().parameters())))
    capture("policy", lambda: MixedPrecisionPolicy(main_grads_dtype=torch.int8))
    with torch.device("meta"):
        meta_model = models.make_model()
    capture("meta_no_shard", lambda: megatron_fsdp.fully_shard_model(meta_model, zero_dp_strategy=0,
                                                                      init_model_with_meta_device=True))
    capture("meta_without_flag", lambda: megatron_fsdp.fully_shard_model(meta_model))
    capture("double_buffer_strategy", lambda: megatron_fsdp.fully_shard_model(
        models.make_model(), zero_dp_strategy=1, fsdp_double_buffer=True))

    nan_model = megatron_fsdp.fully_shard_model(models.make_model(), fsdp_unit_modules=[models.Block],
                                                report_nan_in_param_grad=True)
    inputs = torch.full((2, models.IN_FEATURES), float("nan"))  # checked after the reduction, on every rank
    capture("nan", lambda: (nan_model(inputs).sum().backward(), nan_model.finish_grad_sync()))
    return errors


@pytest.mark.parametrize("world_size", [2])
def test_bad_inputs_raise_clear_errors(world_size):
    errors = run_on_ranks(world_size, _bad_inputs)[0]
    expectations = {
        "strategy": "zero_dp_strategy='zero9' is not a sharding strategy",
        "strategy_int": "zero_dp_strategy=7",
        "mesh_dim": "dp_shard_dim='data' is neither a dim of device_mesh",
        "outer_without_group": "dp_outer_dim needs hybrid_fsdp_group",
        "wrap_twice": "already",
        "wrap_wrapper": "already wrapped",
        "foreign_optimizer": "not part of any MegatronFSDP model",
        "policy": "main_grads_dtype",
        "meta_no_shard": "init_model_with_meta_device=True needs a sharded strategy",
        "meta_without_flag": "init_model_with_meta_device=True",
        "double_buffer_strategy": "fsdp_double_buffer=True",
        "nan": "NaN in the reduced gradients of",
    }
    for key, fragment in expectations.items():
        assert key in errors, f"{key} did not raise"
        assert fragment in errors[key], errors[key]

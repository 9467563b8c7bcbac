"""HFSDP (outer_dp_sharding_strategy='optim') on a 2x2 (dp_outer, dp_shard) mesh at world size 4.

Compute weights are ZeRO-3 sharded over dp_shard; main weights, the optimizer's gradients and Adam state are
split again over dp_outer, so each rank holds a quarter of them. Training must equal single-process AdamW,
bytes held and sent must follow the formulas, clipping must see the global norm, `scale_gradients` must act like
scaling the loss, and checkpoints must move between HFSDP, HSDP and plain 1-D ZeRO-3.
"""

import math

import pytest
import torch

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS = 3
SHARD, OUTER = 2, 2
STEPS_BEFORE_SAVE, STEPS_AFTER_LOAD = 2, 2


_mesh_of_world = None  # (default process group, mesh): every wrap in one world shares the mesh's process groups


def _mesh_kwargs():
    """HFSDP on the (dp_outer, dp_shard) mesh, built once per default process group (a new world builds anew)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    global _mesh_of_world
    if _mesh_of_world is None or _mesh_of_world[0] is not dist.group.WORLD:
        mesh = init_device_mesh("cpu", (OUTER, SHARD), mesh_dim_names=("dp_outer", "dp_shard"))
        _mesh_of_world = (dist.group.WORLD, mesh)
    mesh = _mesh_of_world[1]
    return dict(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                hybrid_fsdp_group=mesh._flatten("dp_outer_shard").get_group(), outer_dp_sharding_strategy="optim")


def _wrap_hfsdp(module, optimizer, **kwargs):
    import megatron_fsdp

    model, optimizer = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[models.Block],
                                                 zero_dp_strategy=3, **_mesh_kwargs(), **kwargs)
    assert model.topology.dp_size == SHARD and model.topology.outer_size == OUTER
    assert all(group.outer_sharded for group in model.groups)
    return model, optimizer


def _hfsdp_model(seed=0, dtype=torch.float32, **kwargs):
    module = models.make_model(seed, dtype)
    return _wrap_hfsdp(module, models.make_optimizer([p for p in module.parameters() if p.requires_grad]), **kwargs)


def _train_variants():
    results = {}
    for overlap in (False, True):
        model, optimizer = _hfsdp_model(overlap_grad_reduce=overlap, overlap_param_gather=overlap)
        results[("fp32", overlap)] = (models.train_sharded(model, optimizer, NUM_STEPS), models.full_params(model))
    model, optimizer = _hfsdp_model(fsdp_double_buffer=True)
    results["double_buffer_accumulation"] = (models.train_sharded(model, optimizer, NUM_STEPS, microbatches=3), None)
    model, optimizer = _hfsdp_model(dtype=torch.bfloat16)
    results["bf16"] = (models.train_sharded(model, optimizer, NUM_STEPS, torch.bfloat16),
                       models.precision_of(model, optimizer))
    return results


@pytest.mark.parametrize("world_size", [4])
def test_hfsdp_matches_single_process(world_size):
    reference, reference_params = models.reference_losses(NUM_STEPS)
    reference_bf16 = models.reference_losses_mixed(NUM_STEPS)
    results = run_on_ranks(world_size, _train_variants)
    for rank_results in results:
        for overlap in (False, True):
            losses, params = rank_results[("fp32", overlap)]
            assert losses == pytest.approx(reference, abs=1e-5), overlap
            assert set(params) == set(reference_params)
            for name, value in params.items():
                torch.testing.assert_close(value, reference_params[name], atol=1e-5, rtol=1e-5, msg=name)
        # overlapping communication changes when collectives run, never what they compute
        assert rank_results[("fp32", False)][0] == rank_results[("fp32", True)][0]
        assert rank_results["double_buffer_accumulation"][0] == pytest.approx(reference, abs=1e-5)
        # bf16 compute weights, fp32 main weights: the tolerance of test_parity.py (gradients summed in bf16)
        bf16_losses, precision = rank_results["bf16"]
        assert bf16_losses == pytest.approx(reference_bf16, abs=2e-2)
        models.assert_ran_in_low_precision(bf16_losses, precision, reference_bf16, reference)


def _meta_versus_eager():
    """Meta-device init under HFSDP: main-weight sub-shards and compute shards equal an eager build's."""
    import megatron_fsdp

    wrapped = []
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        with torch.device(device):
            module = models.TinyModel()
        wrapped.append(megatron_fsdp.fully_shard_model(module, fsdp_unit_modules=[models.Block], zero_dp_strategy=3,
                                                       init_model_with_meta_device=device == "meta",
                                                       **_mesh_kwargs()))
    eager, meta = wrapped
    batch = torch.randn(4, models.IN_FEATURES, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        outputs_equal = torch.equal(eager(batch), meta(batch))  # forward reads the compute shards
    eager_params, meta_params = models.full_params(eager), models.full_params(meta)  # read the main weights
    return outputs_equal, {name: torch.equal(eager_params[name], meta_params[name]) for name in eager_params}


@pytest.mark.parametrize("world_size", [4])
def test_meta_init_equals_eager_init_under_hfsdp(world_size):
    for outputs_equal, params_equal in run_on_ranks(world_size, _meta_versus_eager):
        assert outputs_equal
        assert params_equal and all(params_equal.values()), params_equal


def _accounting():
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[models.Block() for _ in range(4)])
    model, optimizer = _wrap_hfsdp(module, models.make_optimizer(module.parameters()))
    model.schedule.coalesce_gather_bytes = 0  # one gather per group and unit: the theory below
    inputs = torch.randn(4, models.HIDDEN)
    for _ in range(2):
        optimizer.zero_grad()
        model(inputs).square().mean().backward()
        optimizer.step()
    padded = [group.layout.padded_numel for group in model.groups]
    owned = sum(piece.numel for group in model.groups for piece in group.main_pieces)  # this rank's sub-shard
    return (padded, owned, len(list(module.parameters())),
            model.memory_report(), model.communication_report(), dict(model.counter.calls))


@pytest.mark.parametrize("world_size", [4])
def test_bytes_held_and_sent_match_hfsdp_theory(world_size):
    blocks = [models.Block() for _ in range(4)]  # the shapes of the model's four units
    for padded, owned, num_params, memory, comm, calls in run_on_ranks(world_size, _accounting):
        assert all(size % (SHARD * OUTER) == 0 for size in padded)
        total = 4 * sum(padded)  # fp32 bytes of every padded group
        # row-aligned layout: each parameter is chunked in ceil(rows / SHARD) rows per shard rank; each shard is
        # padded at its end to split into OUTER equal sub-shards
        chunks = [sum(math.ceil(p.shape[0] / SHARD) * p[0].numel() for p in block.parameters()) for block in blocks]
        theory = [SHARD * OUTER * math.ceil(chunk / OUTER) for chunk in chunks]
        assert padded == theory, (padded, theory)
        # compute shard 1/SHARD; main weights and optimizer gradients 1/(SHARD*OUTER), Adam's moments the rows
        # in this rank's sub-shard; Adam's step counters are 4-byte scalars, one per parameter
        assert memory["compute_weights"] == total // SHARD
        assert memory["main_weights"] == total // (SHARD * OUTER)
        assert memory["grads"] == total // (SHARD * OUTER)
        assert memory["optimizer_state"] == 2 * 4 * owned + 4 * num_params  # moments: the rows in the sub-shard
        assert memory["transient_now"] == 0  # the shard-sized gradients are dropped after finish_grad_sync
        assert memory["transient_peak"] > 0
        # per step: two gathers (one for the last unit, which stays gathered from its forward to its backward)
        # and one reduce-scatter over dp_shard (ring accounting, bytes x (n-1)/n), then a reduce-scatter of the
        # shard gradients and an all-gather of the main-weight sub-shards over dp_outer
        assert comm["steps"] == 2
        shard_traffic = total * (SHARD - 1) / SHARD
        last_unit_traffic = 4 * padded[-1] * (SHARD - 1) / SHARD  # groups in unit order: one per block
        outer_traffic = (total // SHARD) * (OUTER - 1) / OUTER
        per_step = {kind: comm[kind] / comm["steps"] for kind in ("all_gather", "reduce_scatter", "all_reduce")}
        assert per_step["all_gather"] == pytest.approx(2 * shard_traffic - last_unit_traffic + outer_traffic,
                                                       rel=1e-9)
        assert per_step["reduce_scatter"] == pytest.approx(shard_traffic + outer_traffic, rel=1e-9)
        assert per_step["all_reduce"] == 0
        # one call per group and collective: 2 shard gathers (1 for the last unit) + 1 outer gather, 1 shard + 1
        # outer reduce-scatter
        assert calls["all_gather"] == 2 * (3 * len(padded) - 1) and calls["reduce_scatter"] == 2 * 2 * len(padded)


def _clip(max_norm):
    import torch.distributed as dist

    import megatron_fsdp

    module = models.make_model(0)
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.1)
    model, optimizer = _wrap_hfsdp(module, optimizer)
    inputs, target = (models.local_slice(t, dist.get_rank(), dist.get_world_size()) for t in models.make_batches(1)[0])
    models.loss_fn(model(inputs), target).backward()
    max_abs = megatron_fsdp.clip_grad_norm_(optimizer, 1e9, norm_type=math.inf)  # too large to clip anything
    norm = megatron_fsdp.clip_grad_norm_(optimizer, max_norm)
    optimizer.step()
    return norm.item(), max_abs.item(), models.full_params(model)


@pytest.mark.parametrize("world_size", [4])
def test_clip_grad_norm_counts_every_element_once(world_size):
    model = models.make_model(0)
    inputs, target = models.make_batches(1)[0]
    models.loss_fn(model(inputs), target).backward()
    trainable = [p for p in model.parameters() if p.grad is not None]
    reference_max = max(p.grad.abs().max().item() for p in trainable if p.numel())
    reference_norm = torch.nn.utils.clip_grad_norm_(trainable, 0.05).item()
    assert reference_norm > 0.05  # the clip really scales the gradients
    torch.optim.SGD(trainable, lr=0.1).step()
    for norm, max_abs, params in run_on_ranks(world_size, _clip, 0.05):
        assert norm == pytest.approx(reference_norm, rel=1e-5)
        assert max_abs == pytest.approx(reference_max, rel=1e-5)
        expected = dict(model.named_parameters(remove_duplicate=False))  # the state dict has tied aliases
        assert set(params) == set(expected)
        for name, value in params.items():
            torch.testing.assert_close(value, expected[name].detach(), atol=1e-6, rtol=1e-5)


SCALE_FACTOR = 0.3  # not a power of two: a scaled gradient is rounded, so the checks compare within 1e-6
SGD_LR = 0.1


def _sgd_hfsdp_model(dtype=torch.float32, **kwargs):
    """HFSDP with plain SGD (no momentum): unlike AdamW's, its update is proportional to the gradient scale."""
    module = models.make_model(0, dtype)
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=SGD_LR)
    return _wrap_hfsdp(module, optimizer, **kwargs)


def _scaled_gradient_runs():
    results = {}
    for overlap in (False, True):
        for scale_after_sync in (False, True):
            model, optimizer = _sgd_hfsdp_model(overlap_grad_reduce=overlap, overlap_param_gather=overlap)
            results[(overlap, scale_after_sync)] = models.train_with_gradient_scaling(
                model, optimizer, NUM_STEPS, 1.0, SCALE_FACTOR, scale_after_sync)
    model, optimizer = _sgd_hfsdp_model()
    results["scaled_loss"] = models.train_with_gradient_scaling(model, optimizer, NUM_STEPS, SCALE_FACTOR, None, False)
    model, optimizer = _sgd_hfsdp_model()
    results["unscaled"] = models.train_with_gradient_scaling(model, optimizer, NUM_STEPS, 1.0, None, False)
    # bf16 gradients reach the fp32 optimizer as a copy made by finish_grad_sync: scaling after it must scale that
    bf16 = {}
    for key, loss_factor, grad_factor in (("scaled_grads", 1.0, SCALE_FACTOR), ("scaled_loss", SCALE_FACTOR, None),
                                          ("unscaled", 1.0, None)):
        model, optimizer = _sgd_hfsdp_model(torch.bfloat16)
        bf16[key] = models.train_with_gradient_scaling(model, optimizer, NUM_STEPS, loss_factor, grad_factor, True,
                                                       torch.bfloat16)
    return results, bf16


@pytest.mark.parametrize("world_size", [4])
def test_scale_gradients_equals_scaling_the_loss(world_size):
    for results, bf16 in run_on_ranks(world_size, _scaled_gradient_runs):
        scaled_loss, unscaled = results.pop("scaled_loss"), results.pop("unscaled")
        assert max(abs(a - b) for a, b in zip(scaled_loss, unscaled)) > 1e-3  # the factor changes training
        for (overlap, scale_after_sync), losses in results.items():
            assert losses == pytest.approx(scaled_loss, abs=1e-6), (overlap, scale_after_sync)
        # bf16: scaling the bf16 loss rounds differently from scaling fp32 gradients (measured up to 1.6e-3)
        assert bf16["scaled_grads"] == pytest.approx(bf16["scaled_loss"], abs=5e-3)
        assert max(abs(a - b) for a, b in zip(bf16["scaled_grads"], bf16["unscaled"])) > 5e-2


def _wrap_for_checkpoint(layout, seed):
    """`layout`: "hfsdp" (2x2 mesh, outer dim shards the optimizer), "hsdp" (2x2 mesh, outer dim replicates) or
    "zero3" (1-D over all four ranks)."""
    import megatron_fsdp

    if layout == "hfsdp":
        return _hfsdp_model(seed)
    module = models.make_model(seed)
    optimizer = models.make_optimizer([p for p in module.parameters() if p.requires_grad])
    mesh_kwargs = dict(_mesh_kwargs(), outer_dp_sharding_strategy="no_shard") if layout == "hsdp" else {}
    model, optimizer = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[models.Block],
                                                 zero_dp_strategy=3, **mesh_kwargs)
    assert not any(group.outer_sharded for group in model.groups)
    assert model.topology.outer_size == (OUTER if layout == "hsdp" else 1)
    return model, optimizer


CHECKPOINT_MOVES = (("hfsdp", "zero3"), ("zero3", "hfsdp"), ("hfsdp", "hsdp"), ("hsdp", "hfsdp"))


def _save_then_load_across(directory):
    """For each (saved, loaded) layout pair: train, save model and optimizer with DCP, keep training (the
    uninterrupted losses); then load the file into a freshly initialised model of the other layout and train."""
    import torch.distributed.checkpoint as dcp

    saved_runs, results = {}, {}
    for saved, loaded in CHECKPOINT_MOVES:
        path = f"{directory}_{saved}"
        if saved not in saved_runs:
            model, optimizer = _wrap_for_checkpoint(saved, seed=0)
            models.train_from_step(model, optimizer, STEPS_BEFORE_SAVE, 0)
            dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=path)
            saved_runs[saved] = models.train_from_step(model, optimizer, STEPS_AFTER_LOAD, STEPS_BEFORE_SAVE)

        model, optimizer = _wrap_for_checkpoint(loaded, seed=123)  # everything must come from the file
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        results[(saved, loaded)] = (saved_runs[saved],
                                    models.train_from_step(model, optimizer, STEPS_AFTER_LOAD, STEPS_BEFORE_SAVE))
    return results


@pytest.mark.parametrize("world_size", [4])
def test_checkpoint_moves_between_hfsdp_hsdp_and_zero3(world_size, tmp_path):
    reference, _ = models.reference_losses(STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD)
    results = run_on_ranks(world_size, _save_then_load_across, str(tmp_path / "ckpt"))[0]
    assert set(results) == set(CHECKPOINT_MOVES)
    for move, (uninterrupted, resumed) in results.items():
        assert uninterrupted == pytest.approx(reference[STEPS_BEFORE_SAVE:], abs=1e-5), move
        assert resumed == pytest.approx(uninterrupted, abs=1e-6), move


def _bad_hfsdp_inputs():
    import megatron_fsdp

    errors = {}
    for key, kwargs in (("no_outer_dim", dict(outer_dp_sharding_strategy="optim")),
                        ("zero1", dict(outer_dp_sharding_strategy="optim", zero_dp_strategy=1, **{
                            k: v for k, v in _mesh_kwargs().items() if k != "outer_dp_sharding_strategy"}))):
        try:
            megatron_fsdp.fully_shard_model(models.make_model(), fsdp_unit_modules=[models.Block], **kwargs)
        except ValueError as error:
            errors[key] = str(error)
    return errors


@pytest.mark.parametrize("world_size", [4])
def test_hfsdp_bad_inputs_name_the_flags(world_size):
    errors = run_on_ranks(world_size, _bad_hfsdp_inputs)[0]
    assert "outer_dp_sharding_strategy='optim' (HFSDP) shards over the outer dim" in errors["no_outer_dim"]
    assert "data_parallel_sharding_strategy='optim_grads_params'" in errors["zero1"]


def _flattened_dims_without_slicing_the_root():
    """Upstream's idiom: the sharding dim flattened from (dp_shard, cp), the hybrid group from a flattened "hsdp".
    Megatron-FSDP takes flattened dims from the meshes the root keeps, not by slicing them out of the root (which
    torch deprecates), and the (outer, shard) mesh it builds equals the sliced one."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (OUTER, SHARD, 1), mesh_dim_names=("dp_outer", "dp_shard", "cp"))
    mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    hybrid = mesh[("dp_outer", "dp_shard", "cp")]._flatten("hsdp")
    module = models.make_model(0)
    optimizer = models.make_optimizer([p for p in module.parameters() if p.requires_grad])
    import megatron_fsdp

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, optimizer = megatron_fsdp.fully_shard(
            module, optimizer, fsdp_unit_modules=[models.Block], zero_dp_strategy=3, device_mesh=mesh,
            dp_shard_dim="dp_shard_cp", dp_outer_dim="dp_outer", hybrid_fsdp_group=hybrid.get_group(),
            outer_dp_sharding_strategy="optim")
        built = model.topology.checkpoint_mesh().mesh
    slicing = [str(w.message) for w in caught if "Slicing a flattened dim" in str(w.message)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sliced = mesh[("dp_outer", "dp_shard_cp")]
    groups_agree = all(
        dist.get_process_group_ranks(built.get_group(dim)) == dist.get_process_group_ranks(sliced.get_group(dim))
        for dim in range(2))
    return slicing, built.mesh.tolist(), sliced.mesh.tolist(), built.mesh_dim_names, groups_agree


@pytest.mark.parametrize("world_size", [4])
def test_flattened_mesh_dims_are_not_sliced_out_of_the_root(world_size):
    results = run_on_ranks(world_size, _flattened_dims_without_slicing_the_root)
    for slicing, built, sliced, names, groups_agree in results:
        assert slicing == [] and built == sliced and names == ("dp_outer", "dp_shard_cp") and groups_agree

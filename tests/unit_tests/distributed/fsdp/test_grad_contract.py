"""The gradient contract of `fully_shard` models, for strategies 0-3 x outer strategy none / no_shard (HSDP) /
optim (HFSDP), at 2 and 4 ranks.

With `model.set_model_auto_sync(False)` on the microbatches before the last, no parameter has a `.grad` on any
rank; after the last microbatch's backward with `set_model_auto_sync(True)`, every trainable parameter's `.grad`
is a DTensor of the parameter's shape holding this rank's part of the reduced gradient: its local tensor, cut
from the single-process gradient by the DTensor's own placements (rows for `Shard(0)`, everything for
`Replicate()`; `Partial()` parts summed over their mesh dim, each part equal to the gradient where it is not
zero), equals that gradient within 1e-6 (fp32), and is non-zero on at least one rank; torch's
`clip_grad_norm_` over them sees the single-process norm. Also with gradients kept in fp32 for a bf16 model.
HFSDP needs strategy 3 and says so for the others.
"""

import pytest
import torch

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

MICROBATCHES = 3  # 12 rows: 2 per microbatch at 2 ranks, 1 at 4
TOLERANCE = dict(rtol=1e-6, atol=1e-6)


_meshes = {}  # mesh shape -> (default process group, mesh, hybrid group): the cases of one world share them


def _mesh_kwargs(outer, mesh_shape):
    """The (dp_outer, dp_shard) mesh of `mesh_shape`, built once per default process group (a new world, e.g.
    under torchrun, builds anew)."""
    if outer is None:
        return {}
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if mesh_shape not in _meshes or _meshes[mesh_shape][0] is not dist.group.WORLD:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp_outer", "dp_shard"))
        _meshes[mesh_shape] = (dist.group.WORLD, mesh, mesh._flatten("dp_outer_shard").get_group())
    _, mesh, hybrid_group = _meshes[mesh_shape]
    return dict(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", hybrid_fsdp_group=hybrid_group,
                outer_dp_sharding_strategy=outer)


def _microbatches(rank, world, dtype):
    inputs, target = (models.local_slice(t, rank, world).to(dtype) for t in models.make_batches(1)[0])
    size = inputs.shape[0] // MICROBATCHES
    return [(inputs[m * size:(m + 1) * size], target[m * size:(m + 1) * size]) for m in range(MICROBATCHES)]


def _bf16_reference(world):
    """The reduced gradient a bf16 model with fp32 gradients must show: each rank's bf16 microbatch gradients,
    in fp32, averaged over the ranks (computed here, with this process's kernels, as the ranks compute them)."""
    model = models.make_model(0, torch.bfloat16)
    sums = {}
    for rank in range(world):
        for inputs, target in _microbatches(rank, world, torch.bfloat16):
            model.zero_grad()
            (models.loss_fn(model(inputs), target) / MICROBATCHES).backward()
            for name, param in model.named_parameters():
                if param.grad is not None:
                    sums[name] = sums.get(name, 0) + param.grad.float() / world
    return sums


def _grads_under_the_contract(cases):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import megatron_fsdp

    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for strategy, outer, mesh_shape, dtype in cases:
        module = models.make_model(0, dtype)
        optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.1)
        try:
            model, optimizer = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[models.Block],
                                                         zero_dp_strategy=strategy, **_mesh_kwargs(outer, mesh_shape))
        except ValueError as error:
            results[(strategy, outer, mesh_shape, dtype)] = str(error)
            continue
        optimizer.zero_grad()
        early = []  # names with a .grad after each microbatch before the last
        for micro, (inputs, target) in enumerate(_microbatches(rank, world, dtype)):
            last = micro == MICROBATCHES - 1
            model.set_model_auto_sync(last)
            (models.loss_fn(model(inputs), target) / MICROBATCHES).backward()
            if not last:
                early += [name for name, p in model.module.named_parameters() if p.grad is not None]
        grads = {}
        for name, param in model.module.named_parameters():
            grad = param.grad
            if grad is None:
                grads[name] = None
            elif not isinstance(grad, DTensor):
                grads[name] = type(grad).__name__
            else:
                mesh = grad.device_mesh
                grads[name] = (tuple(grad.shape) == tuple(param.shape), grad.dtype, tuple(grad.placements),
                               tuple(mesh.mesh.flatten().tolist()), tuple(mesh.shape), tuple(mesh.get_coordinate()),
                               grad.to_local().detach().clone())
        # DTensor operations on them are exact: torch's clipping sees the global norm (1e9: nothing is clipped)
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1e9)
        optimizer.step()  # the optimizer still steps on these gradients
        results[(strategy, outer, mesh_shape, dtype)] = (early, grads, norm.full_tensor().item())
    # the driver reads rank 0's reference only
    needs_reference = rank == 0 and any(case[3] == torch.bfloat16 for case in cases)
    return results, (_bf16_reference(world) if needs_reference else None)


def _fp32_reference():
    model = models.make_model(0)
    inputs, target = models.make_batches(1)[0]
    models.loss_fn(model(inputs), target).backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _expected_local(reference, placements, mesh_shape, coordinate):
    """The part of `reference` a local tensor with these placements holds at `coordinate` (before summing
    Partial() parts): rows for Shard(0), all of it for Replicate() and Partial()."""
    from torch.distributed.tensor import Shard

    from megatron_fsdp.layout import chunk_rows

    expected = reference
    for dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            assert placement.dim == 0, placement
            start, end = chunk_rows(expected.shape[0], mesh_shape[dim], coordinate[dim])
            expected = expected[start:end]
    return expected


def _check_case(case, per_rank, reference, grad_dtype):
    from torch.distributed.tensor import Partial

    early = [name for rank_result in per_rank for name in rank_result[0]]
    assert early == [], (case, early)
    names = set(per_rank[0][1])
    trainable = {name for name in names if per_rank[0][1][name] is not None}
    assert trainable == set(reference), (case, trainable ^ set(reference))
    for name in sorted(trainable):
        infos = [rank_result[1][name] for rank_result in per_rank]
        assert all(isinstance(info, tuple) for info in infos), (case, name, infos)  # a DTensor on every rank
        shape_ok, dtype, placements, _, mesh_shape, _, _ = infos[0]
        assert shape_ok and dtype == grad_dtype, (case, name, dtype)
        partial_dims = [dim for dim, placement in enumerate(placements) if isinstance(placement, Partial)]
        sums = {}
        for _, _, rank_placements, mesh_ranks, _, coordinate, local in infos:
            assert rank_placements == placements, (case, name)
            expected = _expected_local(reference[name], placements, mesh_shape, coordinate)
            assert local.shape == expected.shape, (case, name, coordinate, local.shape, expected.shape)
            # where a Partial() part holds a value, it is the gradient's
            support = local != 0 if partial_dims else torch.ones_like(local, dtype=torch.bool)
            torch.testing.assert_close(local[support], expected[support].to(local.dtype), **TOLERANCE,
                                       msg=f"{case} {name} {coordinate}")
            # the parts summed: the ranks of one mesh that differ only in their Partial() coordinates
            key = (mesh_ranks, tuple(c for dim, c in enumerate(coordinate) if dim not in partial_dims))
            total, _ = sums.get(key, (0, expected))
            sums[key] = (total + local, expected)
        for key, (total, expected) in sums.items():
            torch.testing.assert_close(total, expected.to(total.dtype), **TOLERANCE, msg=f"{case} {name} {key}")
        if reference[name].abs().sum() > 0:
            assert any(info[-1].abs().sum() > 0 for info in infos), (case, name)
    reference_norm = torch.linalg.vector_norm(torch.stack([grad.norm() for grad in reference.values()])).item()
    for rank_result in per_rank:
        assert rank_result[2] == pytest.approx(reference_norm, rel=1e-6), case


def _run_and_check(world_size, cases):
    per_rank = run_on_ranks(world_size, _grads_under_the_contract, cases)
    fp32_reference, bf16_reference = _fp32_reference(), per_rank[0][1]
    checked = 0
    for case in cases:
        strategy, outer, _, dtype = case
        results = [rank_results[case] for rank_results, _ in per_rank]
        if outer == "optim" and strategy != 3:
            assert all(isinstance(r, str) and "optim_grads_params" in r for r in results), (case, results)
            continue
        reference = bf16_reference if dtype == torch.bfloat16 else fp32_reference
        _check_case(case, results, reference, torch.float32)
        checked += 1
    return checked


@pytest.mark.parametrize("world_size", [2])
def test_grad_contract_at_two_ranks(world_size):
    """1-D over both ranks (bf16 too), and a 2 x 1 (outer, shard) mesh: every reduction is over the outer dim."""
    cases = [(s, None, None, torch.float32) for s in range(4)]
    cases += [(s, None, None, torch.bfloat16) for s in range(4)]
    cases += [(s, outer, (2, 1), torch.float32) for outer in ("no_shard", "optim") for s in range(4)]
    assert _run_and_check(world_size, cases) == 13


@pytest.mark.parametrize("world_size", [4])
def test_grad_contract_at_four_ranks(world_size):
    """A 2 x 2 (outer, shard) mesh: HSDP under every strategy, HFSDP (fp32 and bf16)."""
    cases = [(s, "no_shard", (2, 2), torch.float32) for s in range(4)]
    cases += [(3, "optim", (2, 2), torch.float32), (3, "optim", (2, 2), torch.bfloat16)]
    assert _run_and_check(world_size, cases) == 6

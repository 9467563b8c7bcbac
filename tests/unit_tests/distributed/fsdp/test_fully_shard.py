"""Scripts written the way users of the upstream Megatron-FSDP package write them run unchanged: a 1-D mesh with
`fully_shard`, and the 4-D (dp_outer, dp_shard, cp, tp) mesh with flattened `dp_shard_cp` / `hsdp` dims, the
optimizer built from the wrapped model and passed to `fully_shard_optimizer`."""

import pytest
import torch

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS = 3


def _one_dimensional_script():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from megatron_fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    module = models.make_model(0)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    model, optimizer = fully_shard(module, optimizer, device_mesh=mesh, dp_shard_dim="dp",
                                   fsdp_unit_modules=[models.Block], zero_dp_strategy="optim_grads_params")
    return models.train_sharded(model, optimizer, NUM_STEPS)


def _hybrid_script(outer_dp_sharding_strategy):
    from torch.distributed.device_mesh import init_device_mesh

    from megatron_fsdp import fully_shard_model, fully_shard_optimizer

    mesh = init_device_mesh("cpu", (2, 2, 1, 1), mesh_dim_names=("dp_outer", "dp_shard", "cp", "tp"))
    mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    mesh[("dp_outer", "dp_shard", "cp")]._flatten("hsdp")
    model = fully_shard_model(
        module=models.make_model(0), device_mesh=mesh, dp_shard_dim="dp_shard_cp", dp_outer_dim="dp_outer",
        tp_dim="tp", hybrid_fsdp_group=mesh["hsdp"].get_group(), fsdp_unit_modules=[models.Block],
        zero_dp_strategy=3, outer_dp_sharding_strategy=outer_dp_sharding_strategy)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    optimizer = fully_shard_optimizer(optimizer)
    assert model.topology.dp_size == 2 and model.topology.outer_size == 2
    return models.train_sharded(model, optimizer, NUM_STEPS)


@pytest.mark.parametrize("world_size", [3])
def test_one_dimensional_upstream_style_script(world_size):
    reference, _ = models.reference_losses(NUM_STEPS)
    for losses in run_on_ranks(world_size, _one_dimensional_script):
        assert losses == pytest.approx(reference, abs=1e-5)


@pytest.mark.parametrize("world_size", [4])
def test_flattened_mesh_dims_upstream_style_script(world_size):
    reference, _ = models.reference_losses(NUM_STEPS)
    for outer in ("no_shard", "optim"):
        for losses in run_on_ranks(world_size, _hybrid_script, outer):
            assert losses == pytest.approx(reference, abs=1e-5), outer

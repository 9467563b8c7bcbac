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


_BLOCK_PATH = "tests.unit_tests.distributed.fsdp.fsdp_test_models.Block"


def _earlier_upstream_keywords_script():
    """Upstream's earlier `fully_shard` signature (its README's): grad_reduce_in_fp32, preserve_fp32_weights,
    check_for_nan_in_grad, nccl_ub; units named by dotted path."""
    import megatron_fsdp
    from megatron_fsdp import fully_shard

    module = models.make_model(0, torch.bfloat16)
    optimizer = models.make_optimizer([p for p in module.parameters() if p.requires_grad])
    model, optimizer = fully_shard(module, optimizer, fsdp_unit_modules=[_BLOCK_PATH], zero_dp_strategy=3,
                                   grad_reduce_in_fp32=True, preserve_fp32_weights=False, check_for_nan_in_grad=True,
                                   nccl_ub=True, disable_symmetric_registration=True)
    results = {"precision": models.precision_of(model, optimizer),
               "policy": (model.policy.main_params_dtype, model.policy.grad_comm_dtype),
               "report_nan": model.schedule.report_nan_in_param_grad,
               "units": [group.names for group in model.groups]}
    results["losses"] = models.train_sharded(model, optimizer, NUM_STEPS, torch.bfloat16)
    by_class = megatron_fsdp.fully_shard_model(models.make_model(0), fsdp_unit_modules=models.Block)
    results["units_by_one_class"] = [group.names for group in by_class.groups]
    errors = {}
    for name, kwargs in {
        "missing_class": dict(fsdp_unit_modules=[_BLOCK_PATH + "Missing"]),
        "missing_module": dict(fsdp_unit_modules=["no_such_package.Block"]),
        "preserve_and_bf16_main": dict(preserve_fp32_weights=False,
                                       mixed_precision_policy=megatron_fsdp.MixedPrecisionPolicy(torch.bfloat16)),
        "nan_flags": dict(check_for_nan_in_grad=False, report_nan_in_param_grad=True),
    }.items():
        try:
            megatron_fsdp.fully_shard_model(models.make_model(0), **kwargs)
        except ValueError as error:
            errors[name] = str(error)
    results["errors"] = errors
    return results


@pytest.mark.parametrize("world_size", [2])
def test_earlier_upstream_keywords_and_dotted_unit_names(world_size):
    from tests.unit_tests.distributed.fsdp.test_upstream_api import _reference_low_precision

    reference_bf16 = _reference_low_precision(NUM_STEPS)
    for results in run_on_ranks(world_size, _earlier_upstream_keywords_script):
        # preserve_fp32_weights=False: AdamW steps the bf16 weights themselves, as test_upstream_api's no-main run
        assert results["precision"] == ({torch.bfloat16}, {torch.bfloat16})
        assert results["policy"] == (None, torch.float32)  # grad_reduce_in_fp32
        assert results["losses"] == pytest.approx(reference_bf16, abs=2e-2)
        assert results["report_nan"] is True
        assert results["units"] == results["units_by_one_class"]
        for index in range(3):  # each Block is a unit of its own
            assert [name for name in results["units"][index] if not name.startswith(f"blocks.{index}.")] == []
        errors = results["errors"]
        assert set(errors) == {"missing_class", "missing_module", "preserve_and_bf16_main", "nan_flags"}
        assert "fsdp_unit_modules entry" in errors["missing_class"] and "BlockMissing" in errors["missing_class"]
        assert "fsdp_unit_modules entry 'no_such_package.Block'" in errors["missing_module"]
        assert "preserve_fp32_weights=False contradicts" in errors["preserve_and_bf16_main"]
        assert "report_nan_in_param_grad=True" in errors["nan_flags"]

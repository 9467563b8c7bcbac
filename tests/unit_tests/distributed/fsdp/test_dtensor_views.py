"""`megatron_fsdp.dtensor_views`: DTensors over views of a flat buffer, and making such a DTensor a parameter
in place (`dtensor_parameter`) as `nn.Parameter` would, minus its `detach()`."""

import pytest
import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks


def _parameters_over_views():
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from megatron_fsdp.dtensor_views import dtensor_over_view, dtensor_parameter

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    buffer = torch.arange(24, dtype=torch.float32) + 100 * rank
    local = buffer[6:12].view(3, 2)  # this rank's 3 rows of a (3 * world, 2) parameter, at an offset
    shape = (3 * world, 2)
    made = dtensor_parameter(dtensor_over_view(local, mesh, [Shard(0)], shape, (2, 1)), True)
    reference = nn.Parameter(dtensor_over_view(local, mesh, [Shard(0)], shape, (2, 1)), requires_grad=True)
    module = nn.Module()
    module.weight = made  # registered as a parameter: nn.Module.__setattr__ checks isinstance(value, Parameter)
    frozen = dtensor_parameter(dtensor_over_view(local, mesh, [Shard(0)], shape, (2, 1)), False)
    buffer[6] = -1.0  # the parameter is still a view of the buffer
    refusal = None
    try:
        dtensor_parameter(dtensor_over_view(local.clone().requires_grad_(), mesh, [Shard(0)], shape, (2, 1)) * 2,
                          True)
    except ValueError as error:
        refusal = str(error)
    return {
        "is_parameter": isinstance(made, nn.Parameter) and isinstance(reference, nn.Parameter),
        "registered": [name for name, _ in module.named_parameters()],
        "leaf_and_grad": (made.is_leaf, made.requires_grad, frozen.requires_grad),
        "as_nn_parameter": (made.shape == reference.shape, made.stride() == reference.stride(),
                            made.placements == reference.placements, made.dtype == reference.dtype),
        "full": made.full_tensor().tolist(),
        "reference_full": reference.full_tensor().tolist(),
        "local_first": made.to_local()[0, 0].item(),
        "refusal": refusal,
    }


@pytest.mark.parametrize("world_size", [2])
def test_dtensor_parameter_is_the_parameter_nn_parameter_makes(world_size):
    for result in run_on_ranks(world_size, _parameters_over_views):
        assert result["is_parameter"]
        assert result["registered"] == ["weight"]
        assert result["leaf_and_grad"] == (True, True, False)
        assert result["as_nn_parameter"] == (True, True, True, True)
        expected = []
        for owner in range(world_size):  # each rank's rows: elements 6-11 of its buffer, the first one set to -1
            rows = [[6.0 + 2 * row + column + 100 * owner for column in range(2)] for row in range(3)]
            rows[0][0] = -1.0
            expected += rows
        assert result["full"] == expected
        assert result["reference_full"] == expected  # both view the same (changed) buffer
        assert result["local_first"] == -1.0
        assert "leaf DTensor" in result["refusal"]

"""Upstream's `MegatronFSDP(module, dist_index=FSDPDistributedIndex(...), ddp_config=..., nccl_ub=..., ...)` trains
as the mesh keywords do; a mesh given twice, or a keyword contradicting the config, is refused by name."""

import pytest

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS = 2


def _train_built_from_a_distributed_index():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import megatron_fsdp

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    model = megatron_fsdp.MegatronFSDP(
        module=models.make_model(0),
        dist_index=megatron_fsdp.FSDPDistributedIndex(device_mesh=mesh, dp_shard_dim="dp"),
        ddp_config=megatron_fsdp.DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params"),
        fsdp_unit_modules=[models.Block],
        # the keywords upstream's fully_shard_model passes besides the config
        keep_fp8_transpose_cache=False, nccl_ub=False, fsdp_double_buffer=False, disable_symmetric_registration=False,
        enable_fine_grained_param_gather_hook=False,
    )
    optimizer = megatron_fsdp.fully_shard_optimizer(
        models.make_optimizer([p for p in model.parameters() if p.requires_grad]))
    return models.train_sharded(model, optimizer, NUM_STEPS), model.topology.dp_size


@pytest.mark.parametrize("world_size", [2])
def test_megatron_fsdp_built_from_a_distributed_index_trains_like_one_process(world_size):
    expected, _ = models.reference_losses(NUM_STEPS)
    for losses, dp_size in run_on_ranks(world_size, _train_built_from_a_distributed_index):
        assert dp_size == world_size
        assert losses == pytest.approx(expected, rel=1e-5)


def test_a_distributed_index_and_mesh_keywords_together_are_refused():
    import megatron_fsdp

    index = megatron_fsdp.FSDPDistributedIndex(device_mesh="mesh", dp_shard_dim="dp", dp_outer_dim="outer",
                                               hsdp_outer_dp_shard=True)
    config = megatron_fsdp.DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params",
                                                         outer_dp_sharding_strategy="optim")
    with pytest.raises(ValueError, match=r"either as dist_index or as device_mesh, dp_shard_dim, not both"):
        megatron_fsdp.MegatronFSDP(models.make_model(0), config, dist_index=index, device_mesh="mesh",
                                   dp_shard_dim="dp")
    with pytest.raises(ValueError, match=r"dist_index.hsdp_outer_dp_shard=True contradicts "
                                         r"ddp_config.outer_dp_sharding_strategy"):
        megatron_fsdp.MegatronFSDP(models.make_model(0), dist_index=index)
    arguments = index.mesh_arguments(dict(device_mesh=None), outer_dp_shards=True)
    assert arguments == ("mesh", "dp", "outer", None, None, None)


def test_upstream_constructor_keywords_are_applied_or_refused_by_name():
    import megatron_fsdp
    from megatron_fsdp.distributed_index import apply_upstream_keywords

    config = megatron_fsdp.DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params")
    defaults = dict(nccl_ub=False, disable_symmetric_registration=False, fsdp_double_buffer=None,
                    keep_fp8_transpose_cache=False, enable_fine_grained_param_gather_hook=False)
    module = models.make_model(0)
    module.inp._fp8_keep_transpose = False  # what an FP8-capable linear layer of Megatron-Core carries
    buffers = apply_upstream_keywords(module, config, None, **{
        **defaults, "nccl_ub": True, "disable_symmetric_registration": True, "keep_fp8_transpose_cache": True})
    assert buffers == megatron_fsdp.NcclUserBuffers(symmetric=False) and module.inp._fp8_keep_transpose
    refused = (
        (dict(enable_fine_grained_param_gather_hook=True), r"enable_fine_grained_param_gather_hook=True is not"),
        (dict(fsdp_double_buffer=True), r"fsdp_double_buffer=True contradicts ddp_config.fsdp_double_buffer=False"),
        (dict(disable_symmetric_registration=True), r"disable_symmetric_registration=True needs nccl_ub=True"),
    )
    for keywords, message in refused:
        with pytest.raises(ValueError, match=message):
            megatron_fsdp.MegatronFSDP(models.make_model(0), config, **keywords)

"""Upstream's constructor arguments of `MegatronFSDP`: `FSDPDistributedIndex`, its bundle of mesh arguments, and
the keywords upstream passes besides the config (`nccl_ub`, `fsdp_double_buffer`, ...).

`MegatronFSDP(module, dist_index=FSDPDistributedIndex(device_mesh, dp_shard_dim=...), ddp_config=...)` is the
same as passing the mesh keywords to `MegatronFSDP` (or `fully_shard_model`) directly; the topology built from
them (topology.py) checks them.
"""

from typing import Optional

from .nccl_allocator import NcclUserBuffers

MESH_KEYWORDS = ("device_mesh", "dp_shard_dim", "dp_outer_dim", "tp_dim", "hybrid_fsdp_group", "expt_device_mesh")


class FSDPDistributedIndex:
    """The mesh, its dim names and groups, as upstream's constructor takes them. `hsdp_outer_dp_shard=True`
    (HFSDP: also shard across `dp_outer_dim`) is the config's `outer_dp_sharding_strategy='optim'`."""

    def __init__(self, device_mesh=None, dp_shard_dim: Optional[str] = None, dp_outer_dim: Optional[str] = None,
                 tp_dim: Optional[str] = None, hybrid_fsdp_group=None, hsdp_outer_dp_shard: bool = False,
                 expt_device_mesh=None):
        self.device_mesh = device_mesh
        self.dp_shard_dim = dp_shard_dim
        self.dp_outer_dim = dp_outer_dim
        self.tp_dim = tp_dim
        self.hybrid_fsdp_group = hybrid_fsdp_group
        self.hsdp_outer_dp_shard = hsdp_outer_dp_shard
        self.expt_device_mesh = expt_device_mesh

    def mesh_arguments(self, given: dict, outer_dp_shards: bool) -> tuple:
        """The values of `MESH_KEYWORDS` this index stands for. `given`: those keywords as passed besides it
        (each must be None); `outer_dp_shards`: whether the config shards across the outer dim (HFSDP)."""
        passed = [name for name, value in given.items() if value is not None]
        if passed:
            raise ValueError(f"MegatronFSDP: pass the mesh either as dist_index or as {', '.join(passed)}, not both")
        if self.hsdp_outer_dp_shard != outer_dp_shards:
            raise ValueError(
                f"MegatronFSDP: dist_index.hsdp_outer_dp_shard={self.hsdp_outer_dp_shard} contradicts "
                "ddp_config.outer_dp_sharding_strategy (HFSDP, sharding across the outer dim, is 'optim'); make them "
                "agree")
        return tuple(getattr(self, name) for name in MESH_KEYWORDS)


def apply_upstream_keywords(module, config, nccl_user_buffers: Optional[NcclUserBuffers], *, nccl_ub: bool,
                            disable_symmetric_registration: bool, fsdp_double_buffer: Optional[bool],
                            keep_fp8_transpose_cache: bool, enable_fine_grained_param_gather_hook: bool):
    """Upstream `MegatronFSDP`'s own keywords, checked against `config` and applied to `module`; returns the
    `NcclUserBuffers` to allocate from (`nccl_ub=True` is `NcclUserBuffers(symmetric=not
    disable_symmetric_registration)`)."""
    if enable_fine_grained_param_gather_hook:
        raise ValueError("MegatronFSDP: enable_fine_grained_param_gather_hook=True is not implemented: units are "
                         "gathered one fsdp_unit_modules instance at a time; drop it")
    if fsdp_double_buffer is not None and fsdp_double_buffer != config.fsdp_double_buffer:
        raise ValueError(f"MegatronFSDP: fsdp_double_buffer={fsdp_double_buffer} contradicts "
                         f"ddp_config.fsdp_double_buffer={config.fsdp_double_buffer}; set it in the config")
    if disable_symmetric_registration and not nccl_ub:
        raise ValueError("MegatronFSDP: disable_symmetric_registration=True needs nccl_ub=True")
    if keep_fp8_transpose_cache:
        for submodule in module.modules():
            if hasattr(submodule, "_fp8_keep_transpose"):  # Megatron-Core's FP8-capable linear layers
                submodule._fp8_keep_transpose = True
    if not nccl_ub:
        return nccl_user_buffers
    if nccl_user_buffers is not None:
        raise ValueError("MegatronFSDP: pass nccl_ub=True or nccl_user_buffers, not both")
    return NcclUserBuffers(symmetric=not disable_symmetric_registration)

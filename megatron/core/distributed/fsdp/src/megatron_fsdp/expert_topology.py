"""The topology of Megatron-FSDP's expert groups: the ranks Mixture-of-Experts expert parameters are sharded,
gathered and reduced over (the expert data-parallel ranks), from the expert device mesh a caller passes."""

from typing import Optional

from .topology import DataParallelTopology


def _expert_tp_dim(expt_device_mesh, data_parallel_dims) -> Optional[str]:
    """The expert mesh's tensor-parallel dim: the one that is not a data-parallel dim (None if it has none). It
    is named apart from the dense `tp_dim`, which is None at a dense tensor-parallel size of 1 even where the
    experts are split (ETP > TP = 1)."""
    others = [name for name in (expt_device_mesh.mesh_dim_names or ()) if name not in data_parallel_dims]
    return others[0] if others else None


def expert_topology(dense: DataParallelTopology, strategy, expt_device_mesh, dp_shard_dim, dp_outer_dim,
                    expt_hybrid_fsdp_group, config) -> Optional[DataParallelTopology]:
    """The topology of the expert groups beside the dense topology `dense`: `expt_device_mesh`'s shard dim (its
    only dim, or `dp_shard_dim`), under HSDP / HFSDP its `dp_outer_dim`, with expert tensor parallelism its
    tensor-parallel dim (the expert mesh has one only when the experts are split: their tensor-parallel size may
    differ from the dense layers'); None without an expert mesh."""
    if expt_device_mesh is None:
        if expt_hybrid_fsdp_group is not None:
            raise ValueError("expt_hybrid_fsdp_group spans the outer x shard dims of expt_device_mesh; pass "
                             "expt_device_mesh too (or neither)")
        return None
    if dense.outer_group is not None:
        return _hybrid_expert_topology(dense, strategy, expt_device_mesh, dp_shard_dim, dp_outer_dim,
                                       expt_hybrid_fsdp_group, config)
    if expt_hybrid_fsdp_group is not None:
        raise ValueError("expt_hybrid_fsdp_group is for HSDP / HFSDP (dp_outer_dim); without an outer dim the "
                         "expert mesh has none: drop it")
    # The experts' tensor-parallel split (the expert mesh's tensor-parallel dim) may differ from the dense one's:
    # an expert mesh without it holds experts whole (expert tensor-parallel size 1).
    if expt_device_mesh.ndim == 1:
        return DataParallelTopology(expt_device_mesh, data_parallel_sharding_strategy=strategy, device=dense.device)
    return DataParallelTopology(expt_device_mesh, dp_shard_dim, None,
                                _expert_tp_dim(expt_device_mesh, (dp_shard_dim,)), None,
                                data_parallel_sharding_strategy=strategy, device=dense.device)


def _hybrid_expert_topology(dense: DataParallelTopology, strategy, expt_device_mesh, dp_shard_dim, dp_outer_dim,
                            expt_hybrid_fsdp_group, config) -> DataParallelTopology:
    """HSDP / HFSDP with expert groups: the expert mesh's `dp_outer_dim` holds the same replicas as the dense
    one, its `dp_shard_dim` the expert data-parallel ranks of one replica."""
    names = tuple(expt_device_mesh.mesh_dim_names or ())
    if dp_outer_dim not in names or dp_shard_dim not in names:
        raise ValueError(f"HSDP / HFSDP with expt_device_mesh: the expert mesh needs dims named like the dense "
                         f"outer and shard dims ({dp_outer_dim!r}, {dp_shard_dim!r}), got {names}")
    if expt_hybrid_fsdp_group is None:
        raise ValueError("HSDP / HFSDP with expt_device_mesh needs expt_hybrid_fsdp_group, the group spanning "
                         f"the expert mesh's {dp_outer_dim!r} x {dp_shard_dim!r} ranks (every expert "
                         "data-parallel rank)")
    topology = DataParallelTopology(
        expt_device_mesh, dp_shard_dim, dp_outer_dim,
        _expert_tp_dim(expt_device_mesh, (dp_outer_dim, dp_shard_dim)),
        expt_hybrid_fsdp_group, data_parallel_sharding_strategy=strategy,
        outer_dp_sharding_strategy=config.outer_dp_sharding_strategy,
        num_distributed_optimizer_instances=config.num_distributed_optimizer_instances,
        device=dense.device)
    if topology.outer_size != dense.outer_size:
        raise ValueError(f"expt_device_mesh's {dp_outer_dim!r} dim has {topology.outer_size} ranks but the "
                         f"dense one {dense.outer_size}: both count the same replicas")
    return topology

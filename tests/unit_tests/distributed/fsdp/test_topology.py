"""`DataParallelTopology`: the sizes, ranks and groups it reports for 1-D, HSDP/HFSDP and TP meshes, the
arguments it rejects (each error names the argument), and that it cannot be changed once built.

Each world size runs its cases in one `run_on_ranks` call: building a pool of ranks costs more than every case.
"""

import pytest

from tests.unit_tests.multiprocess_harness import run_on_ranks

OUTER, SHARD, TP = 2, 2, 2


def _place(topology):
    """What a topology reports, in plain values that travel back from the ranks."""
    from megatron_fsdp import collectives

    return dict(
        dp_shard_dim=topology.dp_shard_dim, device=str(topology.device),
        dp_size=topology.dp_size, dp_rank=topology.dp_rank, dp_ranks=collectives.group_ranks(topology.dp_group),
        outer_size=topology.outer_size, outer_rank=topology.outer_rank,
        outer_ranks=None if topology.outer_group is None else collectives.group_ranks(topology.outer_group),
        optimizer_outer_size=topology.optimizer_outer_size, optimizer_outer_rank=topology.optimizer_outer_rank,
        tp_size=topology.tp_size, tp_rank=topology.tp_rank,
        tp_ranks=None if topology.tp_group is None else collectives.group_ranks(topology.tp_group),
    )


def _one_dim_places():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from megatron_fsdp.topology import DataParallelTopology

    world = dist.get_world_size()
    named = DataParallelTopology(init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)),
                                 data_parallel_sharding_strategy="optim_grads_params")
    return {
        "no_mesh": _place(DataParallelTopology(data_parallel_sharding_strategy=3)),
        "named_mesh": _place(named),
        "unnamed_mesh": _place(DataParallelTopology(init_device_mesh("cpu", (world,)),
                                                    data_parallel_sharding_strategy="optim")),
        "named_checkpoint_mesh": (named.checkpoint_mesh().mesh.mesh.tolist(), named.checkpoint_mesh().dp_mesh_dim),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_one_dim_world_mesh_reports_every_rank_as_a_shard(world_size):
    for rank, places in enumerate(run_on_ranks(world_size, _one_dim_places)):
        everyone = list(range(world_size))
        expected = dict(device="cpu", dp_size=world_size, dp_rank=rank, dp_ranks=everyone, outer_size=1,
                        outer_rank=0, outer_ranks=None, optimizer_outer_size=1, optimizer_outer_rank=0,
                        tp_size=1, tp_rank=0, tp_ranks=None)
        assert places["no_mesh"] == dict(expected, dp_shard_dim=None)
        assert places["named_mesh"] == dict(expected, dp_shard_dim="dp")
        assert places["unnamed_mesh"] == dict(expected, dp_shard_dim=0)  # the mesh's only dim, by index
        assert places["named_checkpoint_mesh"] == (everyone, 0)


def _hybrid_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (OUTER, SHARD), mesh_dim_names=("dp_outer", "dp_shard"))
    return dict(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                hybrid_fsdp_group=mesh._flatten("dp_outer_shard").get_group())


def _places_and_errors_at_world_4():
    from torch.distributed.device_mesh import init_device_mesh

    from megatron_fsdp.topology import DataParallelTopology

    hybrid = _hybrid_mesh()
    tp_mesh = init_device_mesh("cpu", (SHARD, TP), mesh_dim_names=("dp_shard", "tp"))
    tp_topology = DataParallelTopology(tp_mesh, dp_shard_dim="dp_shard", tp_dim="tp",
                                       data_parallel_sharding_strategy=3)
    checkpoint_mesh = tp_topology.checkpoint_mesh()
    places = {
        "hsdp": _place(DataParallelTopology(**hybrid, data_parallel_sharding_strategy=3,
                                            num_distributed_optimizer_instances=OUTER)),
        "hfsdp": _place(DataParallelTopology(**hybrid, data_parallel_sharding_strategy=3,
                                             outer_dp_sharding_strategy="optim")),
        "tp": _place(tp_topology),
        "tp_checkpoint_mesh": (checkpoint_mesh.mesh.mesh_dim_names, checkpoint_mesh.mesh.mesh.tolist(),
                               checkpoint_mesh.dp_mesh_dim, checkpoint_mesh.tp_mesh_dim,
                               tp_topology.checkpoint_mesh() is checkpoint_mesh),
    }

    # Outer 2 x shard 1 x tp 2: a hybrid group of the right size (2) whose ranks are the TP peers instead.
    three_dims = init_device_mesh("cpu", (OUTER, 1, TP), mesh_dim_names=("dp_outer", "dp_shard", "tp"))
    wrong_ranks = dict(device_mesh=three_dims, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", tp_dim="tp",
                       hybrid_fsdp_group=three_dims["tp"].get_group())
    world_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    no_hybrid_group = {k: v for k, v in hybrid.items() if k != "hybrid_fsdp_group"}
    bad_inputs = {
        "unknown_shard_dim": dict(hybrid, dp_shard_dim="dp_shard_cp"),
        "unknown_tp_dim": dict(device_mesh=tp_mesh, dp_shard_dim="dp_shard", tp_dim="tensor"),
        "dim_index_out_of_range": dict(device_mesh=tp_mesh, dp_shard_dim=0, tp_dim=2),
        "same_dim_twice": dict(device_mesh=tp_mesh, dp_shard_dim="dp_shard", tp_dim="dp_shard"),
        "outer_dim_without_hybrid_group": no_hybrid_group,
        "hybrid_group_without_outer_dim": dict(device_mesh=world_mesh, hybrid_fsdp_group=hybrid["hybrid_fsdp_group"]),
        "hybrid_group_too_small": dict(hybrid, hybrid_fsdp_group=hybrid["device_mesh"]["dp_shard"].get_group()),
        "hybrid_group_of_other_ranks": wrong_ranks,
        "hfsdp_without_outer_dim": dict(device_mesh=world_mesh, outer_dp_sharding_strategy="optim"),
        "hfsdp_with_strategy_1": dict(hybrid, outer_dp_sharding_strategy="optim", data_parallel_sharding_strategy=1),
        "instances_without_outer_dim": dict(num_distributed_optimizer_instances=2),
        "instances_not_outer_size": dict(hybrid, num_distributed_optimizer_instances=4),
        "two_dims_without_shard_dim": dict(device_mesh=tp_mesh),
        "dims_without_mesh": dict(dp_shard_dim="dp"),
        "unknown_strategy": dict(data_parallel_sharding_strategy="zero9"),
    }
    errors = {}
    for case, kwargs in bad_inputs.items():
        try:
            DataParallelTopology(**{"data_parallel_sharding_strategy": 3, **kwargs})
        except ValueError as error:
            errors[case] = str(error)
        else:
            errors[case] = None

    topology = DataParallelTopology(**hybrid, data_parallel_sharding_strategy=3)
    writes = {}
    for name, action in (("dp_size", lambda: setattr(topology, "dp_size", 8)),
                         ("outer_group", lambda: setattr(topology, "outer_group", None)),
                         ("new_attribute", lambda: setattr(topology, "new_attribute", 1)),
                         ("dp_group", lambda: delattr(topology, "dp_group"))):
        try:
            action()
        except AttributeError as error:
            writes[name] = str(error)
        else:
            writes[name] = None
    unchanged = (topology.dp_size, topology.outer_group is not None, hasattr(topology, "new_attribute"))
    return places, errors, writes, unchanged


@pytest.mark.parametrize("world_size", [4])
def test_topologies_at_world_4(world_size):
    results = run_on_ranks(world_size, _places_and_errors_at_world_4)
    for rank, (places, errors, writes, unchanged) in enumerate(results):
        outer_index, shard_index = divmod(rank, SHARD)  # mesh [[0, 1], [2, 3]]: rows are shard groups
        hsdp = dict(dp_shard_dim="dp_shard", device="cpu", dp_size=SHARD, dp_rank=shard_index,
                    dp_ranks=[outer_index * SHARD + i for i in range(SHARD)], outer_size=OUTER,
                    outer_rank=outer_index, outer_ranks=[i * SHARD + shard_index for i in range(OUTER)],
                    optimizer_outer_size=1, optimizer_outer_rank=0, tp_size=1, tp_rank=0, tp_ranks=None)
        assert places["hsdp"] == hsdp
        # HFSDP: the same groups, but the main weights are split over the outer ranks too
        assert places["hfsdp"] == dict(hsdp, optimizer_outer_size=OUTER, optimizer_outer_rank=outer_index)

        shard_index, tp_index = divmod(rank, TP)  # mesh [[0, 1], [2, 3]]: rows are TP groups
        assert places["tp"] == dict(
            dp_shard_dim="dp_shard", device="cpu", dp_size=SHARD, dp_rank=shard_index,
            dp_ranks=[i * TP + tp_index for i in range(SHARD)], outer_size=1, outer_rank=0, outer_ranks=None,
            optimizer_outer_size=1, optimizer_outer_rank=0, tp_size=TP, tp_rank=tp_index,
            tp_ranks=[shard_index * TP + i for i in range(TP)])
        # tp before dp_shard, so a TP partition is cut into rows afterwards; built once, then reused
        assert places["tp_checkpoint_mesh"] == (("tp", "dp_shard"), [[0, 2], [1, 3]], 1, 0, True)

        assert errors["unknown_shard_dim"].startswith("dp_shard_dim='dp_shard_cp' is neither a dim of device_mesh")
        assert errors["unknown_tp_dim"].startswith("tp_dim='tensor' is neither a dim of device_mesh")
        assert errors["dim_index_out_of_range"].startswith("tp_dim=2 is not a dim index of device_mesh (2 dims")
        assert errors["same_dim_twice"].startswith("dp_shard_dim and tp_dim both name dim 'dp_shard'")
        assert errors["outer_dim_without_hybrid_group"].startswith("dp_outer_dim needs hybrid_fsdp_group")
        assert errors["hybrid_group_without_outer_dim"].startswith("hybrid_fsdp_group is the group spanning")
        assert errors["hybrid_group_too_small"].startswith(
            f"hybrid_fsdp_group holds ranks {hsdp['dp_ranks']}, but dp_shard_dim 'dp_shard' x dp_outer_dim "
            "'dp_outer' of this rank span 2 x 2 ranks")
        tp_peers = [outer_index * TP + i for i in range(TP)]  # rank r's TP peers on the (2, 1, 2) mesh
        assert errors["hybrid_group_of_other_ranks"].startswith(
            f"hybrid_fsdp_group holds ranks {tp_peers}, but dp_shard_dim 'dp_shard' x dp_outer_dim 'dp_outer' of "
            "this rank span 1 x 2 ranks")
        assert errors["hfsdp_without_outer_dim"].startswith(
            "outer_dp_sharding_strategy='optim' (HFSDP) shards over the outer dim of device_mesh")
        assert errors["hfsdp_with_strategy_1"] == (
            "outer_dp_sharding_strategy='optim' (HFSDP) needs data_parallel_sharding_strategy="
            "'optim_grads_params' (zero_dp_strategy=3), got 'optim'")
        assert errors["instances_without_outer_dim"].startswith(
            "num_distributed_optimizer_instances=2 needs a dp_outer_dim of that size (the optimizer replicas), but "
            "the outer size is 1")
        assert errors["instances_not_outer_size"].startswith(
            "num_distributed_optimizer_instances=4 needs a dp_outer_dim of that size (the optimizer replicas), but "
            "the outer size is 2")
        assert errors["two_dims_without_shard_dim"] == (
            "device_mesh has 2 dims ('dp_shard', 'tp'); name the sharding dim with dp_shard_dim")
        assert errors["dims_without_mesh"].startswith("dp_shard_dim / dp_outer_dim / tp_dim name dims of device_mesh")
        assert errors["unknown_strategy"].startswith("data_parallel_sharding_strategy='zero9' is not a sharding")

        for name in ("dp_size", "outer_group", "new_attribute"):
            assert writes[name] == (f"DataParallelTopology is read-only after construction: cannot set {name!r}; "
                                    "build a new topology with the arguments you want instead")
        assert writes["dp_group"] == "DataParallelTopology is read-only after construction: cannot delete 'dp_group'"
        assert unchanged == (SHARD, True, False)

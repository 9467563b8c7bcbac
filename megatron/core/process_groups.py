"""The process groups of the parallel layout: create them, destroy them, and look them up by name.

`initialize_model_parallel` asks `torch.distributed` for one process group per rank list of
`rank_layout.generate_rank_groups` (every rank creates every group in the same order, as `new_group` requires),
keeps the groups this rank belongs to, and builds the stage's `(dp_outer, dp_shard_cp, tp)` device mesh on them.
It takes Megatron-Core's parameters in Megatron-Core's positional order; an option this implementation cannot
honour (SHARP, ...) raises a ValueError that names it rather than being ignored. The number of virtual pipeline
stages (model chunks) per pipeline rank is recorded here too; it creates no group.
This module owns the state; the named getters over it are in `parallel_state.py`.
"""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.core.rank_layout import (
    DEFAULT_ORDER,
    DEVICE_MESH_DIM_NAMES,
    device_mesh_layout,
    generate_rank_groups,
    hierarchical_context_parallel_groups,
)

# name -> (process group, ranks) for the groups this rank belongs to.
_GROUPS = {}
_INITIALIZED = False
_CREATED_GROUPS = []
# gloo twins of the data-parallel groups: name -> process group.
_GLOO_GROUPS = {}
_DEVICE_MESH = None
_NUM_DISTRIBUTED_OPTIMIZER_INSTANCES = 1
# Interleaved pipeline: model chunks per pipeline rank (None without interleaving) and the chunk being built or
# run (None outside model construction and the schedule).
_VIRTUAL_PIPELINE_WORLD_SIZE = None
_VIRTUAL_PIPELINE_RANK = None


def _backend_device_type():
    backend = str(dist.get_backend()).lower()
    return "cuda" if "nccl" in backend else "cpu"


def initialize_model_parallel(
    tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1,
    virtual_pipeline_model_parallel_size=None,
    pipeline_model_parallel_comm_backend=None,
    use_sharp=False,
    context_parallel_size=1,
    hierarchical_context_parallel_sizes=None,
    expert_model_parallel_size=1,
    num_distributed_optimizer_instances=1,
    expert_tensor_parallel_size=None,
    nccl_communicator_config_path=None,
    distributed_timeout_minutes=30,
    order=DEFAULT_ORDER,
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    create_gloo_process_groups=True,
    high_priority_stream_groups=None,
    sharp_enabled_group=None,
):
    """Create every process group for the layout on the already-initialised default process group.

    The parameters and their positional order are Megatron-Core's. Those this implementation cannot honour
    fail with a message (see `reject_unsupported_options`) instead of being ignored.
    `get_embedding_ranks(pp_ranks)` / `get_position_embedding_ranks(pp_ranks)` pick the ranks of one
    pipeline's (position) embedding group (defaults: first and last stage / first stage).
    `create_gloo_process_groups` adds gloo copies of the data-parallel groups for CPU-side traffic; on a gloo
    world they are the data-parallel groups themselves.
    """
    global _DEVICE_MESH, _NUM_DISTRIBUTED_OPTIMIZER_INSTANCES, _INITIALIZED, _VIRTUAL_PIPELINE_WORLD_SIZE
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call torch.distributed.init_process_group first")
    if model_parallel_is_initialized():
        raise RuntimeError("model parallel groups are already initialised; call destroy_model_parallel() first")
    backend = str(dist.get_backend()).lower()
    reject_unsupported_options(
        backend,
        tensor_model_parallel_size=tensor_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        pipeline_model_parallel_comm_backend=pipeline_model_parallel_comm_backend,
        use_sharp=use_sharp,
        hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes,
        nccl_communicator_config_path=nccl_communicator_config_path,
        distributed_timeout_minutes=distributed_timeout_minutes,
        high_priority_stream_groups=high_priority_stream_groups,
        sharp_enabled_group=sharp_enabled_group,
    )
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    groups = generate_rank_groups(
        world_size,
        tp=tensor_model_parallel_size,
        pp=pipeline_model_parallel_size,
        cp=context_parallel_size,
        ep=expert_model_parallel_size,
        order=order,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        etp=expert_tensor_parallel_size,
    )
    if hierarchical_context_parallel_sizes is not None:
        groups.update(hierarchical_context_parallel_groups(groups["cp"], hierarchical_context_parallel_sizes))
    groups["embedding"] = _custom_pipeline_groups(groups["pp"], get_embedding_ranks, "get_embedding_ranks",
                                                  default=groups["embedding"])
    groups["position-embedding"] = _custom_pipeline_groups(
        groups["pp"], get_position_embedding_ranks, "get_position_embedding_ranks",
        default=[[ranks[0]] for ranks in groups["pp"]],
    )
    timeout = timedelta(minutes=distributed_timeout_minutes)
    # Identical rank lists share one process group (e.g. dp and dp-cp when cp == 1).
    by_ranks = {}
    for name, rank_lists in groups.items():
        for ranks in rank_lists:
            key = tuple(ranks)
            if key not in by_ranks:
                group = dist.new_group(ranks=list(ranks), timeout=timeout)
                by_ranks[key] = group
                if rank in ranks:
                    _CREATED_GROUPS.append(group)
            if rank in ranks:
                _GROUPS[name] = (by_ranks[key], list(ranks))
    if create_gloo_process_groups:
        _create_gloo_data_parallel_groups(groups, rank, backend, timeout)
    _NUM_DISTRIBUTED_OPTIMIZER_INSTANCES = num_distributed_optimizer_instances
    _VIRTUAL_PIPELINE_WORLD_SIZE = virtual_pipeline_model_parallel_size
    _INITIALIZED = True
    _DEVICE_MESH = _build_device_mesh(groups, rank, num_distributed_optimizer_instances)
    # No rank may go on (and possibly destroy these groups) while a peer is still connecting them.
    dist.barrier()


def _build_device_mesh(groups, rank, num_distributed_optimizer_instances):
    """The stage's (dp_outer, dp_shard_cp, tp) DeviceMesh on the outer, inner data-parallel and tensor groups."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = device_mesh_layout(groups, rank, num_distributed_optimizer_instances)
    return DeviceMesh.from_group(
        [_GROUPS["outer-dp-cp"][0], _GROUPS["inner-dp-cp"][0], _GROUPS["tp"][0]],
        _backend_device_type(),
        mesh=torch.tensor(mesh, dtype=torch.int),
        mesh_dim_names=DEVICE_MESH_DIM_NAMES,
    )


def reject_unsupported_options(
    backend,
    tensor_model_parallel_size=1,
    virtual_pipeline_model_parallel_size=None,
    pipeline_model_parallel_comm_backend=None,
    use_sharp=False,
    hierarchical_context_parallel_sizes=None,
    nccl_communicator_config_path=None,
    distributed_timeout_minutes=30,
    high_priority_stream_groups=None,
    sharp_enabled_group=None,
):
    """Raise ValueError for an `initialize_model_parallel` option this implementation cannot honour.

    `backend` is the default process group's backend ("gloo", "nccl", ...). Every message names the option
    and the value that works.
    """
    if virtual_pipeline_model_parallel_size is not None and (
        isinstance(virtual_pipeline_model_parallel_size, bool)
        or not isinstance(virtual_pipeline_model_parallel_size, int)
        or virtual_pipeline_model_parallel_size < 1
    ):
        raise ValueError(
            f"virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size!r}: the number of model "
            "chunks per pipeline rank (--num-virtual-stages-per-pipeline-rank) must be an integer >= 1, or None"
        )
    if pipeline_model_parallel_comm_backend not in (None, backend):
        raise ValueError(
            f"pipeline_model_parallel_comm_backend={pipeline_model_parallel_comm_backend!r}: pipeline groups use the "
            f"default process group's backend ({backend!r}); leave it None"
        )
    nccl = "nccl" in backend
    if use_sharp or sharp_enabled_group is not None:
        where = ("NCCL's SHARP support is not implemented yet" if nccl else
                 f"SHARP is an NCCL feature and this world's backend is {backend!r}")
        raise ValueError(f"use_sharp={use_sharp!r}, sharp_enabled_group={sharp_enabled_group!r}: {where}; "
                         "leave use_sharp False and sharp_enabled_group None")
    if hierarchical_context_parallel_sizes is not None and (
        isinstance(hierarchical_context_parallel_sizes, (str, bytes))
        or not all(isinstance(size, int) and not isinstance(size, bool) and size >= 1
                   for size in hierarchical_context_parallel_sizes)
    ):
        raise ValueError(
            f"hierarchical_context_parallel_sizes={hierarchical_context_parallel_sizes!r} "
            "(--hierarchical-context-parallel-sizes) must be a list of positive integers (inner to outer) whose "
            "product is the context-parallel size, or None"
        )
    if nccl_communicator_config_path is not None or high_priority_stream_groups is not None:
        what = ("nccl_communicator_config_path" if nccl_communicator_config_path is not None
                else "high_priority_stream_groups")
        where = "not implemented yet" if nccl else f"an NCCL option and this world's backend is {backend!r}"
        raise ValueError(f"{what}: {where}; leave it None")
    if isinstance(distributed_timeout_minutes, bool) or not isinstance(distributed_timeout_minutes, (int, float)) \
            or distributed_timeout_minutes <= 0:
        raise ValueError(f"distributed_timeout_minutes must be a positive number, got {distributed_timeout_minutes!r}")


def _custom_pipeline_groups(pipeline_groups, choose_ranks, option, default):
    """Per pipeline, the ranks `choose_ranks(pp_ranks)` names (all members of that pipeline), or `default`."""
    if choose_ranks is None:
        return default
    chosen = []
    for pp_ranks in pipeline_groups:
        ranks = list(choose_ranks(list(pp_ranks)))
        if not ranks or any(r not in pp_ranks for r in ranks) or len(set(ranks)) != len(ranks):
            raise ValueError(
                f"{option}({pp_ranks}) returned {ranks}: it must return distinct ranks of that pipeline group"
            )
        chosen.append(ranks)
    return chosen


def _create_gloo_data_parallel_groups(groups, rank, backend, timeout):
    """gloo twins of the (expert) data-parallel groups (the groups themselves when the world runs on gloo)."""
    for name in ("dp", "dp-cp", "inner-dp-cp", "expt-dp", "inner-expt-dp"):
        if name not in groups:
            continue  # inner-expt-dp: the optimizer instances do not divide the expert data-parallel size
        if backend == "gloo":
            _GLOO_GROUPS[name] = _GROUPS[name][0]
            continue
        for ranks in groups[name]:
            group = dist.new_group(ranks=list(ranks), timeout=timeout, backend="gloo")
            if rank in ranks:
                _CREATED_GROUPS.append(group)
                _GLOO_GROUPS[name] = group


def model_parallel_is_initialized():
    return _INITIALIZED


def _forget_meshes_of_destroyed_groups():
    """torch caches DTensor sharding decisions, which carry their device mesh, keyed by meshes that compare equal
    whenever their ranks and dim names do. Groups built again after this would otherwise meet that cache and run
    a DTensor's collectives (e.g. `full_tensor()`) on a mesh of the destroyed groups."""
    if "torch.distributed.tensor" not in sys.modules:
        return  # DTensor was never imported, so it has cached nothing (and importing it costs a second of CPU)
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def destroy_model_parallel():
    """Destroy the process groups created by `initialize_model_parallel` and reset the module state."""
    global _DEVICE_MESH, _NUM_DISTRIBUTED_OPTIMIZER_INSTANCES, _INITIALIZED
    global _VIRTUAL_PIPELINE_WORLD_SIZE, _VIRTUAL_PIPELINE_RANK
    if dist.is_initialized():
        for group in _CREATED_GROUPS:
            dist.destroy_process_group(group)
    _forget_meshes_of_destroyed_groups()
    _CREATED_GROUPS.clear()
    _GROUPS.clear()
    _GLOO_GROUPS.clear()
    _DEVICE_MESH = None
    _NUM_DISTRIBUTED_OPTIMIZER_INSTANCES = 1
    _VIRTUAL_PIPELINE_WORLD_SIZE = None
    _VIRTUAL_PIPELINE_RANK = None
    _INITIALIZED = False


# --------------------------------------------------------------------------------------------------------
# Lookups (the named getters in parallel_state.py are built on these)
# --------------------------------------------------------------------------------------------------------


def group_named(name):
    """This rank's process group of kind `name` (a key of `generate_rank_groups`)."""
    if not _INITIALIZED:
        raise RuntimeError(f"{name} group is not initialised; call initialize_model_parallel() first")
    if name not in _GROUPS:
        raise RuntimeError(f"rank {dist.get_rank()} belongs to no {name} group (e.g. a middle pipeline stage)")
    return _GROUPS[name][0]


def ranks_of(name):
    """The global ranks of this rank's group of kind `name`."""
    group_named(name)
    return _GROUPS[name][1]


def rank_in(name):
    """This rank's position in its group of kind `name`."""
    return ranks_of(name).index(dist.get_rank())


def belongs_to(name):
    """Whether this rank is in a group of kind `name` (False before initialisation)."""
    return _INITIALIZED and name in _GROUPS


def gloo_group_named(name):
    """The gloo twin of this rank's data-parallel group of kind `name`."""
    group_named(name)
    if name not in _GLOO_GROUPS:
        raise RuntimeError("gloo data-parallel groups were not created; pass create_gloo_process_groups=True to "
                           "initialize_model_parallel()")
    return _GLOO_GROUPS[name]


def get_num_distributed_optimizer_instances():
    return _NUM_DISTRIBUTED_OPTIMIZER_INSTANCES


def get_virtual_pipeline_world_size():
    return _VIRTUAL_PIPELINE_WORLD_SIZE


def set_virtual_pipeline_world_size(world_size):
    global _VIRTUAL_PIPELINE_WORLD_SIZE
    _VIRTUAL_PIPELINE_WORLD_SIZE = world_size


def get_virtual_pipeline_rank():
    return _VIRTUAL_PIPELINE_RANK


def set_virtual_pipeline_rank(rank):
    global _VIRTUAL_PIPELINE_RANK
    _VIRTUAL_PIPELINE_RANK = rank


def get_device_mesh():
    """(dp_outer, dp_shard_cp, tp) mesh of this rank's pipeline stage, built on the groups above."""
    if _DEVICE_MESH is None:
        raise RuntimeError("device mesh is not initialised; call initialize_model_parallel() first")
    return _DEVICE_MESH

"""`DataParallelTopology`: the process groups and mesh dims this rank shards, replicates and tensor-parallelises
over, checked once when it is built and read-only afterwards.

Every rule that depends on how the ranks are arranged lives here: the named mesh dims exist, `hybrid_fsdp_group`
spans the outer x shard ranks, HFSDP has an outer dim to shard over and a strategy that shards the compute
weights, and `num_distributed_optimizer_instances` matches the outer size. Rules between flags alone (such as
overlap_param_gather needing overlap_grad_reduce) belong to `DistributedDataParallelConfig`.
"""

import itertools
from typing import NamedTuple, Optional, Union

import torch

from . import collectives
from .distributed_data_parallel_config import ShardingStrategy
from .utils import resolve_device


class CheckpointMesh(NamedTuple):
    """Where state-dict DTensors live: rows over mesh dim `dp_mesh_dim`, TP partitions over `tp_mesh_dim` (None
    without tensor parallelism); any other dim replicates."""

    mesh: object
    dp_mesh_dim: int
    tp_mesh_dim: Optional[int] = None


class DataParallelTopology:
    """The process groups (and DTensor mesh) Megatron-FSDP shards and replicates over.

    With an outer dim, the outer ranks replicate the model (HSDP, `outer_dp_sharding_strategy='no_shard'`) or
    additionally split the main weights, the optimizer's gradients and its state (HFSDP, `'optim'`).

    Dims are names of `device_mesh` (its own or flattened from them, as in `mesh[("dp_shard", "cp")]._flatten(
    "dp_shard_cp")`) or indices of its own dims. Without a mesh the ranks of the world shard and nothing else.
    Sizes, ranks and groups are fixed at construction; assigning an attribute afterwards raises AttributeError.
    """

    def __init__(self, device_mesh=None, dp_shard_dim=None, dp_outer_dim=None, tp_dim=None, hybrid_fsdp_group=None,
                 *, data_parallel_sharding_strategy: Union[str, int, ShardingStrategy],
                 outer_dp_sharding_strategy: Union[str, int, ShardingStrategy] = ShardingStrategy.no_shard,
                 num_distributed_optimizer_instances: int = 1, device=None):
        if not collectives.is_initialized():
            raise RuntimeError("Megatron-FSDP needs torch.distributed initialised (init_process_group) first")
        strategy = ShardingStrategy.parse(data_parallel_sharding_strategy, "data_parallel_sharding_strategy")
        outer_shards_optimizer = ShardingStrategy.parse(
            outer_dp_sharding_strategy, "outer_dp_sharding_strategy") == ShardingStrategy.optim
        _check_arguments_agree(device_mesh, dp_shard_dim, dp_outer_dim, tp_dim, hybrid_fsdp_group, strategy,
                               outer_shards_optimizer)

        outer_group = None
        if device_mesh is None:
            dp_group = torch.distributed.group.WORLD
            device = resolve_device(device, None, collectives.backend_of(dp_group))
        else:
            dp_shard_dim = _check_mesh_dims(device_mesh, dp_shard_dim, dp_outer_dim, tp_dim)
            dp_group = _dim_group(device_mesh, dp_shard_dim)
            if dp_outer_dim is not None:
                outer_group = _dim_group(device_mesh, dp_outer_dim)
            device = resolve_device(device, device_mesh.device_type, collectives.backend_of(dp_group))
        outer_size = 1 if outer_group is None else collectives.group_size(outer_group)
        if hybrid_fsdp_group is not None:
            _check_hybrid_group(hybrid_fsdp_group, dp_group, outer_group, dp_shard_dim, dp_outer_dim)
        if num_distributed_optimizer_instances > 1 and num_distributed_optimizer_instances != outer_size:
            raise ValueError(f"num_distributed_optimizer_instances={num_distributed_optimizer_instances} needs a "
                             f"dp_outer_dim of that size (the optimizer replicas), but the outer size is "
                             f"{outer_size}; pass device_mesh, dp_outer_dim and hybrid_fsdp_group")

        fields = dict(
            device_mesh=device_mesh, dp_shard_dim=dp_shard_dim, dp_outer_dim=dp_outer_dim, tp_dim=tp_dim,
            device=device, dp_group=dp_group, outer_group=outer_group, outer_shards_optimizer=outer_shards_optimizer,
            dp_size=collectives.group_size(dp_group), dp_rank=collectives.group_rank(dp_group),
            outer_size=outer_size, outer_rank=0 if outer_group is None else collectives.group_rank(outer_group),
            tp_group=None if tp_dim is None else device_mesh.get_group(tp_dim),
            tp_size=1 if tp_dim is None else _dim_size(device_mesh, tp_dim),
            tp_rank=0 if tp_dim is None else device_mesh.get_local_rank(tp_dim),
            # Meshes built on first use: building one may create process groups, which every rank must join.
            _checkpoint_meshes={},
        )
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError(f"DataParallelTopology is read-only after construction: cannot set {name!r}; build "
                             "a new topology with the arguments you want instead")

    def __delattr__(self, name):
        raise AttributeError(f"DataParallelTopology is read-only after construction: cannot delete {name!r}")

    @property
    def optimizer_outer_size(self) -> int:
        """How many outer ranks split each shard of the main weights (HFSDP); 1 under HSDP or without one."""
        return self.outer_size if self.outer_shards_optimizer else 1

    @property
    def optimizer_outer_rank(self) -> int:
        return self.outer_rank if self.outer_shards_optimizer else 0

    def shard_mesh(self):
        """A 1-D DeviceMesh over the shard group (`dp_group`): where resting parameters and `.grad` DTensors live."""
        if "shard" not in self._checkpoint_meshes:
            from torch.distributed.device_mesh import DeviceMesh

            self._checkpoint_meshes["shard"] = DeviceMesh.from_group(self.dp_group, self.device.type)
        return self._checkpoint_meshes["shard"]

    def checkpoint_mesh(self) -> CheckpointMesh:
        """The mesh on which state-dict DTensors are placed (see `CheckpointMesh`)."""
        if self.device_mesh is None:
            if "world" not in self._checkpoint_meshes:
                from torch.distributed.device_mesh import init_device_mesh

                world_mesh = init_device_mesh(self.device.type, (collectives.default_world_size(),),
                                              mesh_dim_names=("dp",))
                self._checkpoint_meshes["world"] = CheckpointMesh(world_mesh, 0)
            return self._checkpoint_meshes["world"]
        if self.tp_size > 1:
            if "tensor_parallel" not in self._checkpoint_meshes:
                self._checkpoint_meshes["tensor_parallel"] = self._tensor_parallel_checkpoint_mesh()
            return self._checkpoint_meshes["tensor_parallel"]
        if self.dp_outer_dim is not None:
            return CheckpointMesh(_outer_and_shard_mesh(self.device_mesh, self.dp_outer_dim, self.dp_shard_dim), 1)
        if self.device_mesh.ndim == 1:
            return CheckpointMesh(self.device_mesh, 0)
        return CheckpointMesh(_submesh(self.device_mesh, self.dp_shard_dim), 0)

    def _tensor_parallel_checkpoint_mesh(self) -> CheckpointMesh:
        """A (dp_outer?, tp, dp_shard) mesh. DTensor splits mesh dims in order, so tp must precede dp_shard for
        a TP partition along dim 0 to be cut into rows afterwards; DeviceMesh slicing keeps the original order,
        so the mesh is rebuilt from this rank's rank grid on the existing groups (no new process groups)."""
        from torch.distributed.device_mesh import DeviceMesh

        mesh = self.device_mesh
        names = tuple(mesh.mesh_dim_names or ())
        dims = ([self.dp_outer_dim] if self.dp_outer_dim is not None else []) + [self.tp_dim, self.dp_shard_dim]
        if all(isinstance(dim, str) for dim in dims):
            # Named dims (flattened ones included): slice them in the order DeviceMesh accepts, then reorder.
            submesh = _slice_in_any_order(mesh, dims)
            order = [submesh.mesh_dim_names.index(dim) for dim in dims]
            grid, groups, dim_names = submesh.mesh.permute(order), [submesh.get_group(d) for d in dims], tuple(dims)
        else:
            indices = [dim if isinstance(dim, int) else names.index(dim) for dim in dims]
            others = [index for index in range(mesh.ndim) if index not in indices]
            coordinate = mesh.get_coordinate()
            grid = mesh.mesh.permute(others + indices)[tuple(coordinate[index] for index in others)]
            groups = [mesh.get_group(index) for index in indices]
            dim_names = tuple(names[index] for index in indices) if names else None
        return CheckpointMesh(DeviceMesh.from_group(groups, mesh.device_type, mesh=grid, mesh_dim_names=dim_names),
                              dp_mesh_dim=len(dims) - 1, tp_mesh_dim=len(dims) - 2)


def _check_arguments_agree(device_mesh, dp_shard_dim, dp_outer_dim, tp_dim, hybrid_fsdp_group, strategy,
                           outer_shards_optimizer):
    """The rules between the arguments themselves, before any mesh is looked at."""
    if dp_outer_dim is not None and hybrid_fsdp_group is None:
        raise ValueError("dp_outer_dim needs hybrid_fsdp_group (the process group spanning the outer and shard "
                         "dims); pass both or neither")
    if hybrid_fsdp_group is not None and dp_outer_dim is None:
        raise ValueError("hybrid_fsdp_group is the group spanning the outer and shard dims; it needs dp_outer_dim "
                         "too (pass both or neither)")
    if outer_shards_optimizer and dp_outer_dim is None:
        raise ValueError("outer_dp_sharding_strategy='optim' (HFSDP) shards over the outer dim of device_mesh; "
                         "pass device_mesh, dp_outer_dim and hybrid_fsdp_group")
    if outer_shards_optimizer and strategy != ShardingStrategy.optim_grads_params:
        # The outer all-gather after each step rebuilds the compute shard from the main-weight sub-shards; the
        # other strategies keep compute weights that alias the main weights, which that would split.
        raise ValueError(f"outer_dp_sharding_strategy='optim' (HFSDP) needs data_parallel_sharding_strategy="
                         f"'optim_grads_params' (zero_dp_strategy=3), got '{strategy.name}'")
    if device_mesh is None and (dp_shard_dim is not None or dp_outer_dim is not None or tp_dim is not None):
        raise ValueError("dp_shard_dim / dp_outer_dim / tp_dim name dims of device_mesh; pass device_mesh")


def _check_mesh_dims(device_mesh, dp_shard_dim, dp_outer_dim, tp_dim):
    """Check that every dim names a dim of `device_mesh`, each a different one; returns the sharding dim (the
    only dim of a 1-D mesh when `dp_shard_dim` is None)."""
    names = tuple(device_mesh.mesh_dim_names or ())
    if dp_shard_dim is None:
        if device_mesh.ndim != 1:
            raise ValueError(f"device_mesh has {device_mesh.ndim} dims {names}; name the sharding dim with "
                             "dp_shard_dim")
        dp_shard_dim = names[0] if names else 0
    given = {"dp_shard_dim": dp_shard_dim, "dp_outer_dim": dp_outer_dim, "tp_dim": tp_dim}
    for flag, dim in given.items():
        if dim is None:
            continue
        if isinstance(dim, int):
            if not 0 <= dim < device_mesh.ndim:
                raise ValueError(f"{flag}={dim} is not a dim index of device_mesh ({device_mesh.ndim} dims: {names})")
        elif not isinstance(dim, str) or not _mesh_has_dim(device_mesh, dim):
            raise ValueError(f"{flag}={dim!r} is neither a dim of device_mesh (dims: {names}) nor a dim flattened "
                             "from them (DeviceMesh._flatten)")
    named = [(flag, names[dim] if isinstance(dim, int) and names else dim)
             for flag, dim in given.items() if dim is not None]
    for (flag, dim), (other_flag, other_dim) in itertools.combinations(named, 2):
        if dim == other_dim:
            raise ValueError(f"{flag} and {other_flag} both name dim {dim!r} of device_mesh; each needs a dim of "
                             "its own")
    return dp_shard_dim


def _check_hybrid_group(hybrid_fsdp_group, dp_group, outer_group, dp_shard_dim, dp_outer_dim):
    """`hybrid_fsdp_group` must span exactly the outer x shard ranks of this rank."""
    hybrid_ranks = set(collectives.group_ranks(hybrid_fsdp_group))
    inner_ranks, outer_ranks = collectives.group_ranks(dp_group), collectives.group_ranks(outer_group)
    if len(hybrid_ranks) != len(inner_ranks) * len(outer_ranks) or not (
            hybrid_ranks.issuperset(inner_ranks) and hybrid_ranks.issuperset(outer_ranks)):
        raise ValueError(f"hybrid_fsdp_group holds ranks {sorted(hybrid_ranks)}, but dp_shard_dim {dp_shard_dim!r} "
                         f"x dp_outer_dim {dp_outer_dim!r} of this rank span {len(inner_ranks)} x "
                         f"{len(outer_ranks)} ranks including {inner_ranks} and {outer_ranks}; pass the "
                         "data-parallel group of both dims")


def _flattened_mesh(device_mesh, name: str):
    """The mesh `_flatten(name)` made from dims of `device_mesh`'s root, as the root keeps it (None if there is
    none): taken from there rather than sliced out of the root, which torch deprecates for flattened dims."""
    if name in tuple(device_mesh.mesh_dim_names or ()):
        return None
    get_root = getattr(device_mesh, "_get_root_mesh", None)
    root = get_root() if callable(get_root) else device_mesh
    mapping = getattr(root, "_flatten_mapping", None)
    return mapping.get(name) if isinstance(mapping, dict) else None


def _submesh(device_mesh, name: str):
    """`device_mesh[name]`: one of its dims, or one flattened from them."""
    flattened = _flattened_mesh(device_mesh, name)
    return flattened if flattened is not None else device_mesh[name]


def _outer_and_shard_mesh(device_mesh, outer_dim, shard_dim):
    """`device_mesh[(outer_dim, shard_dim)]`. Where a dim is a flattened one of a root mesh laid out as consecutive
    ranks (init_device_mesh's), the 2-D mesh is built from the two dims' own meshes instead: rank offsets along
    disjoint dims then add up, so the rank at (i, j) is outer_i + shard_j - this rank (torch deprecates slicing
    flattened dims out of the root)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    names = (outer_dim, shard_dim)
    if all(isinstance(name, str) and _flattened_mesh(device_mesh, name) is None for name in names):
        return device_mesh[names]
    get_root = getattr(device_mesh, "_get_root_mesh", None)
    root_ranks = (get_root() if callable(get_root) else device_mesh).mesh.flatten()
    consecutive = torch.arange(root_ranks.numel(), dtype=root_ranks.dtype) + root_ranks[0]
    if not all(isinstance(name, str) for name in names) or not torch.equal(root_ranks, consecutive):
        return device_mesh[names]
    outer, shard = _submesh(device_mesh, outer_dim), _submesh(device_mesh, shard_dim)
    grid = outer.mesh.reshape(-1, 1) + shard.mesh.reshape(1, -1) - dist.get_rank()
    return DeviceMesh.from_group([outer.get_group(), shard.get_group()], device_mesh.device_type, mesh=grid,
                                 mesh_dim_names=names)


def _dim_group(device_mesh, dim):
    """The process group of one dim of `device_mesh` (a 1-D mesh's own group for its only dim)."""
    if device_mesh.ndim == 1:
        return device_mesh.get_group()
    return device_mesh.get_group(dim) if isinstance(dim, int) else _submesh(device_mesh, dim).get_group()


def _dim_size(device_mesh, dim) -> int:
    return device_mesh.size(dim) if isinstance(dim, int) else _submesh(device_mesh, dim).size()


def _mesh_has_dim(device_mesh, name: str) -> bool:
    """Whether `device_mesh[name]` names a dim: one of its own, or one flattened from them (as in
    `mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")`, the usual way to name the sharding dim)."""
    if name in tuple(device_mesh.mesh_dim_names or ()) or _flattened_mesh(device_mesh, name) is not None:
        return True
    try:
        device_mesh[name]
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def _slice_in_any_order(device_mesh, dims):
    """`device_mesh[dims]` with the dims in whichever order DeviceMesh accepts (it keeps the mesh's own order)."""
    for candidate in itertools.permutations(dims):
        try:
            return device_mesh[tuple(candidate)]
        except (KeyError, ValueError, RuntimeError):
            continue
    raise ValueError(f"cannot slice dims {tuple(dims)} out of device_mesh (dims: {device_mesh.mesh_dim_names})")

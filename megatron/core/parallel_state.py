"""Process groups for tensor, pipeline, context, expert and data parallelism, and the device mesh.

Two halves. `generate_rank_groups` is pure arithmetic: it lays the world's ranks out on a grid whose axes
follow `order` (the first axis varies fastest, Megatron's default "tp-cp-ep-dp-pp" puts tensor-parallel
neighbours on consecutive ranks) and returns, for every kind of group, the list of rank lists. It runs
without processes, so the layouts are unit-tested directly. `initialize_model_parallel` then asks
`torch.distributed` for one process group per rank list (every rank creates every group in the same order,
as `new_group` requires) and keeps the groups this rank belongs to; the getters below read them back. It
takes Megatron-Core's parameters in Megatron-Core's positional order; an option this implementation cannot
honour (virtual pipeline stages, SHARP, ...) raises a ValueError that names it rather than being ignored.

Expert parallelism uses its own grid over the same ranks: within a pipeline stage the tp*cp*dp ranks are
re-read as tp x ep x expert-dp (context parallelism folded into expert data parallelism).
"""

import itertools
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
DEVICE_MESH_DIM_NAMES = ("dp_outer", "dp_shard_cp", "tp")
_DIMENSIONS = ("tp", "cp", "ep", "dp", "pp")
_DIMENSION_FLAGS = {
    "tp": "--tensor-model-parallel-size",
    "pp": "--pipeline-model-parallel-size",
    "cp": "--context-parallel-size",
    "ep": "--expert-model-parallel-size",
    "dp": "data-parallel size",
}


# --------------------------------------------------------------------------------------------------------
# Pure rank arithmetic (no torch.distributed)
# --------------------------------------------------------------------------------------------------------


def parse_order(order):
    """Split an order string like "tp-cp-ep-dp-pp" into its dimension names, validating them."""
    names = [name.strip() for name in order.lower().split("-") if name.strip()]
    unknown = [name for name in names if name not in _DIMENSIONS]
    if unknown:
        raise ValueError(f"order {order!r} names unknown dimensions {unknown}; use a permutation of {_DIMENSIONS}")
    if len(set(names)) != len(names):
        raise ValueError(f"order {order!r} repeats a dimension")
    return names


class RankGrid:
    """Ranks laid out on a grid; `order` lists the axes from fastest to slowest varying."""

    def __init__(self, sizes, order):
        self.order = [name for name in order if name in sizes] + [name for name in sizes if name not in order]
        self.sizes = {name: sizes[name] for name in self.order}
        self.strides = {}
        stride = 1
        for name in self.order:
            self.strides[name] = stride
            stride *= self.sizes[name]
        self.world_size = stride

    def rank_of(self, coordinates):
        return sum(coordinates.get(name, 0) * self.strides[name] for name in self.order)

    def coordinates_of(self, rank):
        return {name: (rank // self.strides[name]) % self.sizes[name] for name in self.order}

    def groups(self, dims):
        """Rank lists along `dims` (a set of axis names); one list per combination of the other axes."""
        varying = [name for name in self.order if name in dims]
        fixed = [name for name in self.order if name not in dims]
        groups = []
        # Enumerate the fixed axes with the first one in `order` varying fastest (Megatron's group order).
        for fixed_values in itertools.product(*(range(self.sizes[name]) for name in reversed(fixed))):
            base = dict(zip(reversed(fixed), fixed_values))
            ranks = []
            for varying_values in itertools.product(*(range(self.sizes[name]) for name in reversed(varying))):
                coordinates = dict(base, **dict(zip(reversed(varying), varying_values)))
                ranks.append(self.rank_of(coordinates))
            groups.append(ranks)
        return groups


def validate_parallel_sizes(
    world_size,
    tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1,
    context_parallel_size=1,
    expert_model_parallel_size=1,
    num_distributed_optimizer_instances=1,
):
    """Check the sizes against the world; returns the data-parallel size. Raises ValueError naming the flags."""
    sizes = {
        "--tensor-model-parallel-size": tensor_model_parallel_size,
        "--pipeline-model-parallel-size": pipeline_model_parallel_size,
        "--context-parallel-size": context_parallel_size,
        "--expert-model-parallel-size": expert_model_parallel_size,
        "--num-distributed-optimizer-instances": num_distributed_optimizer_instances,
    }
    for flag, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value!r}")
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    if world_size % model_parallel != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor ({tensor_model_parallel_size}) x pipeline "
            f"({pipeline_model_parallel_size}) x context ({context_parallel_size}) model parallel sizes; "
            "choose sizes whose product divides the number of ranks"
        )
    data_parallel_size = world_size // model_parallel
    if (data_parallel_size * context_parallel_size) % expert_model_parallel_size != 0:
        raise ValueError(
            f"data-parallel ({data_parallel_size}) x context-parallel ({context_parallel_size}) size must be "
            f"divisible by --expert-model-parallel-size ({expert_model_parallel_size})"
        )
    if (data_parallel_size * context_parallel_size) % num_distributed_optimizer_instances != 0:
        raise ValueError(
            f"data-parallel ({data_parallel_size}) x context-parallel ({context_parallel_size}) size must be "
            f"divisible by --num-distributed-optimizer-instances ({num_distributed_optimizer_instances})"
        )
    return data_parallel_size


def generate_rank_groups(world_size, tp=1, pp=1, cp=1, ep=1, dp=None, order=DEFAULT_ORDER,
                         num_distributed_optimizer_instances=1):
    """Every kind of rank group for a layout, as {name: [[global ranks], ...]}.

    Names: "tp", "pp", "cp", "dp" (equal tp/pp/cp coordinates), "dp-cp" (equal tp/pp coordinates),
    "tp-cp", "tp-dp" (equal pp/cp coordinates), "tp-dp-cp" (every rank of one pipeline stage: FP8's
    amax-reduction group), "mp" (tp x pp: the model-parallel group), "embedding" (first and last rank of each
    pipeline), "inner-dp-cp" / "outer-dp-cp" (hybrid sharding: the dp-cp group cut into N consecutive chunks, and the
    ranks at the same position across the chunks), "ep", "expt-dp" (expert grid), "tp-ep".
    `dp` is derived from the world size when None; a given value must agree with it.
    """
    derived_dp = validate_parallel_sizes(world_size, tp, pp, cp, ep, num_distributed_optimizer_instances)
    if dp is not None and dp != derived_dp:
        raise ValueError(
            f"data-parallel size {dp} does not match world size {world_size} / (tp {tp} x pp {pp} x cp {cp}) "
            f"= {derived_dp}"
        )
    dp = derived_dp
    names = parse_order(order)
    requested = {"tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp}
    missing = [name for name in _DIMENSIONS if name not in names and requested[name] > 1]
    if missing:
        raise ValueError(f"order {order!r} must name every dimension with size > 1; missing {missing}")

    dense = RankGrid({"tp": tp, "cp": cp, "dp": dp, "pp": pp}, [n for n in names if n != "ep"])
    groups = {
        "tp": dense.groups({"tp"}),
        "pp": dense.groups({"pp"}),
        "cp": dense.groups({"cp"}),
        "dp": dense.groups({"dp"}),
        "dp-cp": dense.groups({"dp", "cp"}),
        "tp-cp": dense.groups({"tp", "cp"}),
        "tp-dp": dense.groups({"tp", "dp"}),
        "tp-dp-cp": dense.groups({"tp", "dp", "cp"}),
        "mp": dense.groups({"tp", "pp"}),
    }
    groups["embedding"] = [[ranks[0], ranks[-1]] if len(ranks) > 1 else list(ranks) for ranks in groups["pp"]]

    instances = num_distributed_optimizer_instances
    inner_size = (dp * cp) // instances
    groups["inner-dp-cp"] = [
        ranks[start : start + inner_size] for ranks in groups["dp-cp"] for start in range(0, len(ranks), inner_size)
    ]
    groups["outer-dp-cp"] = [ranks[position::inner_size] for ranks in groups["dp-cp"] for position in range(inner_size)]

    expert_dp = (dp * cp) // ep
    expert = RankGrid({"tp": tp, "ep": ep, "dp": expert_dp, "pp": pp}, [n for n in names if n != "cp"])
    groups["ep"] = expert.groups({"ep"})
    groups["expt-dp"] = expert.groups({"dp"})
    groups["tp-ep"] = expert.groups({"tp", "ep"})
    return groups


def device_mesh_layout(groups, rank, num_distributed_optimizer_instances=1):
    """The (dp_outer, dp_shard_cp, tp) mesh of the pipeline stage that holds `rank`, as nested lists.

    mesh[o][i][t] is the rank at tensor-parallel position t, in chunk o of its dp-cp group, position i.
    """
    stage_dp_cp = [g for g in groups["dp-cp"] if g[0] in _pipeline_stage_of(groups, rank)]
    tp_size = len(groups["tp"][0])
    dp_cp_size = len(groups["dp-cp"][0])
    inner = dp_cp_size // num_distributed_optimizer_instances
    # Sort the stage's dp-cp groups by tensor-parallel position of their first rank.
    position_in_tp = {r: g.index(r) for g in groups["tp"] for r in g}
    stage_dp_cp.sort(key=lambda g: position_in_tp[g[0]])
    assert len(stage_dp_cp) == tp_size
    return [
        [[stage_dp_cp[t][o * inner + i] for t in range(tp_size)] for i in range(inner)]
        for o in range(num_distributed_optimizer_instances)
    ]


def _pipeline_stage_of(groups, rank):
    """All ranks that share `rank`'s pipeline stage (same position in their pipeline group)."""
    stage = next(ranks.index(rank) for ranks in groups["pp"] if rank in ranks)
    return {ranks[stage] for ranks in groups["pp"]}


# --------------------------------------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------------------------------------

# name -> (process group, ranks) for the groups this rank belongs to.
_GROUPS = {}
_INITIALIZED = False
_CREATED_GROUPS = []
# gloo twins of the data-parallel groups: name -> process group.
_GLOO_GROUPS = {}
_DEVICE_MESH = None
_NUM_DISTRIBUTED_OPTIMIZER_INSTANCES = 1


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
    global _DEVICE_MESH, _NUM_DISTRIBUTED_OPTIMIZER_INSTANCES, _INITIALIZED
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
        expert_tensor_parallel_size=expert_tensor_parallel_size,
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
    )
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
    _INITIALIZED = True

    from torch.distributed.device_mesh import DeviceMesh

    mesh = device_mesh_layout(groups, rank, num_distributed_optimizer_instances)
    _DEVICE_MESH = DeviceMesh.from_group(
        [_GROUPS["outer-dp-cp"][0], _GROUPS["inner-dp-cp"][0], _GROUPS["tp"][0]],
        _backend_device_type(),
        mesh=torch.tensor(mesh, dtype=torch.int),
        mesh_dim_names=DEVICE_MESH_DIM_NAMES,
    )
    # No rank may go on (and possibly destroy these groups) while a peer is still connecting them.
    dist.barrier()


def reject_unsupported_options(
    backend,
    tensor_model_parallel_size=1,
    virtual_pipeline_model_parallel_size=None,
    pipeline_model_parallel_comm_backend=None,
    use_sharp=False,
    hierarchical_context_parallel_sizes=None,
    expert_tensor_parallel_size=None,
    nccl_communicator_config_path=None,
    distributed_timeout_minutes=30,
    high_priority_stream_groups=None,
    sharp_enabled_group=None,
):
    """Raise ValueError for an `initialize_model_parallel` option this implementation cannot honour.

    `backend` is the default process group's backend ("gloo", "nccl", ...). Every message names the option
    and the value that works.
    """
    if virtual_pipeline_model_parallel_size is not None:
        raise ValueError(
            f"virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size!r}: interleaved pipeline "
            "schedules (virtual pipeline stages) are not implemented; leave it None"
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
    if hierarchical_context_parallel_sizes is not None:
        raise ValueError(
            f"hierarchical_context_parallel_sizes={hierarchical_context_parallel_sizes!r}: hierarchical context "
            "parallelism is not implemented; leave it None"
        )
    if expert_tensor_parallel_size not in (None, tensor_model_parallel_size):
        raise ValueError(
            f"expert_tensor_parallel_size={expert_tensor_parallel_size!r}: experts use the tensor-parallel size "
            f"({tensor_model_parallel_size}); leave it None or equal to tensor_model_parallel_size"
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
    """gloo twins of the data-parallel groups (the groups themselves when the world already runs on gloo)."""
    for name in ("dp", "dp-cp", "inner-dp-cp"):
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


def destroy_model_parallel():
    """Destroy the process groups created by `initialize_model_parallel` and reset the module state."""
    global _DEVICE_MESH, _NUM_DISTRIBUTED_OPTIMIZER_INSTANCES, _INITIALIZED
    if dist.is_initialized():
        for group in _CREATED_GROUPS:
            dist.destroy_process_group(group)
    _CREATED_GROUPS.clear()
    _GROUPS.clear()
    _GLOO_GROUPS.clear()
    _DEVICE_MESH = None
    _NUM_DISTRIBUTED_OPTIMIZER_INSTANCES = 1
    _INITIALIZED = False


def _group(name):
    if not _INITIALIZED:
        raise RuntimeError(f"{name} group is not initialised; call initialize_model_parallel() first")
    if name not in _GROUPS:
        raise RuntimeError(f"rank {dist.get_rank()} belongs to no {name} group (e.g. a middle pipeline stage)")
    return _GROUPS[name][0]


def _ranks(name):
    _group(name)
    return _GROUPS[name][1]


def _rank_in(name):
    return _ranks(name).index(dist.get_rank())


# Tensor model parallel
def get_tensor_model_parallel_group():
    return _group("tp")


def get_tensor_model_parallel_rank():
    return _rank_in("tp") if model_parallel_is_initialized() else 0


def get_tensor_model_parallel_world_size():
    return len(_ranks("tp")) if model_parallel_is_initialized() else 1


def get_tensor_model_parallel_src_rank():
    """Global rank of tensor-parallel rank 0 in this rank's group."""
    return _ranks("tp")[0]


def get_tensor_model_parallel_global_ranks():
    return list(_ranks("tp"))


# Pipeline model parallel
def get_pipeline_model_parallel_group():
    return _group("pp")


def get_pipeline_model_parallel_rank():
    return _rank_in("pp") if model_parallel_is_initialized() else 0


def get_pipeline_model_parallel_world_size():
    return len(_ranks("pp")) if model_parallel_is_initialized() else 1


def is_pipeline_first_stage(ignore_virtual=True):
    """True on the first pipeline stage (`ignore_virtual` is accepted for call-site compatibility)."""
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual=True):
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_virtual_pipeline_model_parallel_world_size():
    """None: interleaved (virtual) pipeline stages are not implemented."""
    return None


def get_virtual_pipeline_model_parallel_rank():
    return None


def get_pipeline_model_parallel_first_rank():
    return _ranks("pp")[0]


def get_pipeline_model_parallel_last_rank():
    return _ranks("pp")[-1]


def get_pipeline_model_parallel_next_rank():
    """Global rank of the next stage (wrapping around from the last stage to the first)."""
    ranks = _ranks("pp")
    return ranks[(_rank_in("pp") + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank():
    ranks = _ranks("pp")
    return ranks[(_rank_in("pp") - 1) % len(ranks)]


# Data parallel
def _data_parallel_name(with_context_parallel, partial_data_parallel):
    if partial_data_parallel:
        if not with_context_parallel:
            raise ValueError("partial_data_parallel=True needs with_context_parallel=True (the inner dp-cp group)")
        return "inner-dp-cp"
    return "dp-cp" if with_context_parallel else "dp"


def get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False):
    """Ranks with equal tp/pp (and cp unless `with_context_parallel`) coordinates.

    `partial_data_parallel` selects the inner group of hybrid sharding (one distributed-optimizer instance).
    """
    return _group(_data_parallel_name(with_context_parallel, partial_data_parallel))


def get_data_parallel_rank(with_context_parallel=False, partial_data_parallel=False):
    if not model_parallel_is_initialized():
        return 0
    return _rank_in(_data_parallel_name(with_context_parallel, partial_data_parallel))


def get_data_parallel_world_size(with_context_parallel=False, partial_data_parallel=False):
    if not model_parallel_is_initialized():
        return 1
    return len(_ranks(_data_parallel_name(with_context_parallel, partial_data_parallel)))


def get_data_parallel_global_ranks(with_context_parallel=False):
    return list(_ranks("dp-cp" if with_context_parallel else "dp"))


def get_data_parallel_src_rank(with_context_parallel=False):
    return _ranks("dp-cp" if with_context_parallel else "dp")[0]


def get_data_parallel_group_gloo(with_context_parallel=False, partial_data_parallel=False):
    """The gloo twin of `get_data_parallel_group(...)` (needs `create_gloo_process_groups=True`)."""
    name = _data_parallel_name(with_context_parallel, partial_data_parallel)
    _group(name)
    if name not in _GLOO_GROUPS:
        raise RuntimeError("gloo data-parallel groups were not created; pass create_gloo_process_groups=True to "
                           "initialize_model_parallel()")
    return _GLOO_GROUPS[name]


def get_inner_data_parallel_group():
    """Hybrid sharding: the DP*CP/N consecutive data-parallel (with context) ranks of this instance."""
    return _group("inner-dp-cp")


def get_outer_data_parallel_group():
    """Hybrid sharding: the N ranks at this rank's position across the distributed-optimizer instances."""
    return _group("outer-dp-cp")


def get_num_distributed_optimizer_instances():
    return _NUM_DISTRIBUTED_OPTIMIZER_INSTANCES


# Context parallel
def get_context_parallel_group():
    return _group("cp")


def get_context_parallel_rank():
    return _rank_in("cp") if model_parallel_is_initialized() else 0


def get_context_parallel_world_size():
    return len(_ranks("cp")) if model_parallel_is_initialized() else 1


def get_context_parallel_global_ranks():
    return list(_ranks("cp"))


def get_tensor_and_context_parallel_group():
    return _group("tp-cp")


def get_tensor_and_data_parallel_group(with_context_parallel=False):
    """The tensor-parallel x data-parallel ranks of this rank's pipeline stage that share its context-parallel
    position; `with_context_parallel`: every rank of the stage (TP x DP x CP)."""
    return _group("tp-dp-cp" if with_context_parallel else "tp-dp")


def get_amax_reduction_group(with_context_parallel=False, tp_only_amax_red=False):
    """The ranks that reduce FP8 amaxes together so they quantize a shared tensor with one scale.

    Every rank of a pipeline stage holds shards (TP) or replicas (DP, CP) of the same layers, so under delayed
    scaling the amaxes are reduced over the stage's TP x DP (x CP with `with_context_parallel`, as FP8
    training uses it) ranks; `tp_only_amax_red` narrows it to the tensor-parallel group (shards agree, replicas
    may not). Megatron-Core's getter; Transformer Engine's autocast takes it as `fp8_group`.
    """
    if tp_only_amax_red:
        return get_tensor_model_parallel_group()
    return get_tensor_and_data_parallel_group(with_context_parallel)


# Expert parallel
def get_expert_model_parallel_group():
    return _group("ep")


def get_expert_model_parallel_rank():
    return _rank_in("ep") if model_parallel_is_initialized() else 0


def get_expert_model_parallel_world_size():
    return len(_ranks("ep")) if model_parallel_is_initialized() else 1


def get_expert_data_parallel_group():
    return _group("expt-dp")


def get_expert_data_parallel_world_size():
    return len(_ranks("expt-dp")) if model_parallel_is_initialized() else 1


def get_expert_tensor_and_model_parallel_group():
    return _group("tp-ep")


# Model parallel, embedding, mesh
def get_model_parallel_group():
    """Tensor x pipeline model-parallel group."""
    return _group("mp")


def get_embedding_group():
    """First and last pipeline stage ranks of this rank's pipeline (only the one rank when PP == 1)."""
    return _group("embedding")


def get_embedding_global_ranks():
    return list(_ranks("embedding"))


def is_rank_in_embedding_group():
    return _INITIALIZED and "embedding" in _GROUPS


def get_position_embedding_group():
    """The ranks of this rank's pipeline that hold position embeddings (the first stage by default)."""
    return _group("position-embedding")


def is_rank_in_position_embedding_group():
    return _INITIALIZED and "position-embedding" in _GROUPS


def get_device_mesh():
    """(dp_outer, dp_shard_cp, tp) mesh of this rank's pipeline stage, built on the groups above."""
    if _DEVICE_MESH is None:
        raise RuntimeError("device mesh is not initialised; call initialize_model_parallel() first")
    return _DEVICE_MESH

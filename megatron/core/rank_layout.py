"""Rank-layout arithmetic for the parallel groups: which global ranks form each tensor, pipeline, context,
expert and data-parallel group, and the device mesh of a pipeline stage, as plain lists (no torch.distributed).

`generate_rank_groups` lays the world's ranks out on a grid whose axes follow `order` (the first axis varies
fastest, Megatron's default "tp-cp-ep-dp-pp" puts tensor-parallel neighbours on consecutive ranks) and returns,
for every kind of group, the list of rank lists. It runs without processes, so the layouts are unit-tested
directly; `process_groups.py` turns the lists into process groups.

Expert parallelism uses its own grid over the same ranks, as upstream's expert rank generator: within a
pipeline stage the tp*cp*dp ranks are re-read as etp x ep x expert-dp (order tp-ep-dp-pp, the expert
tensor-parallel size `etp` in the tp slot, context parallelism folded into expert data parallelism), so
etp x ep x expert-dp = tp x cp x dp. With etp == tp (the default) the expert tensor-parallel groups are the
tensor-parallel ones.
"""

import itertools

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
# Upstream's --use-tp-pp-dp-mapping: pipeline neighbours before data-parallel replicas (no CP or EP with it).
TP_PP_DP_ORDER = "tp-cp-ep-pp-dp"
DEVICE_MESH_DIM_NAMES = ("dp_outer", "dp_shard_cp", "tp")
_DIMENSIONS = ("tp", "cp", "ep", "dp", "pp")


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


class RankGenerator:
    """Megatron-Core's rank generator: the ranks `rank_offset`.. of a tp x ep x dp x pp x cp grid laid out along
    `order` (fastest axis first; axes it leaves out must have size 1 and are appended). `get_ranks("tp-dp")`
    lists the rank groups along the named axes, one per combination of the others, in upstream's order.
    `initialize_model_parallel` builds the decoder's groups on one with ep=1 and the experts' on one with
    tp=ETP, cp=1."""

    def __init__(self, tp, ep, dp, pp, cp, order, rank_offset=0):
        sizes = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        for name, size in sizes.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"RankGenerator: {name} size must be a positive integer, got {size!r}")
        names = parse_order(order)
        missing = [name for name in sizes if name not in names and sizes[name] != 1]
        if missing:
            raise ValueError(f"RankGenerator: order {order!r} must name every axis of size > 1; missing {missing}")
        names += [name for name in sizes if name not in names]
        self.order = "-".join(names)
        self.ordered_size = [sizes[name] for name in names]
        self.rank_offset = rank_offset
        self._grid = RankGrid(sizes, names)
        self.world_size = self._grid.world_size

    def get_mask(self, order, token):
        """For each axis of `order`, whether `token` ("tp-dp", ...) names it."""
        tokens = parse_order(token)
        return [name in tokens for name in parse_order(order)]

    def get_ranks(self, token):
        """The rank groups along the axes `token` names ("tp", "tp-cp", "dp-cp", ...)."""
        dims = set(parse_order(token))
        return [[rank + self.rank_offset for rank in ranks] for ranks in self._grid.groups(dims)]


def validate_parallel_sizes(
    world_size,
    tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1,
    context_parallel_size=1,
    expert_model_parallel_size=1,
    num_distributed_optimizer_instances=1,
    expert_tensor_parallel_size=None,
):
    """Check the sizes against the world; returns the data-parallel size. Raises ValueError naming the flags.

    `expert_tensor_parallel_size` None means the tensor-parallel size."""
    if expert_tensor_parallel_size is None:
        expert_tensor_parallel_size = tensor_model_parallel_size
    sizes = {
        "--tensor-model-parallel-size": tensor_model_parallel_size,
        "--pipeline-model-parallel-size": pipeline_model_parallel_size,
        "--context-parallel-size": context_parallel_size,
        "--expert-model-parallel-size": expert_model_parallel_size,
        "--expert-tensor-parallel-size": expert_tensor_parallel_size,
        "--num-distributed-optimizer-instances": num_distributed_optimizer_instances,
    }
    for flag, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value!r}")
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    if world_size % model_parallel != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tensor_model_parallel_size})"
            f" x --pipeline-model-parallel-size ({pipeline_model_parallel_size}) x --context-parallel-size "
            f"({context_parallel_size}) (tensor_model_parallel_size, pipeline_model_parallel_size and "
            "context_parallel_size of initialize_model_parallel); choose sizes whose product divides the number of "
            "ranks"
        )
    data_parallel_size = world_size // model_parallel
    stage_size = tensor_model_parallel_size * context_parallel_size * data_parallel_size
    if stage_size % (expert_tensor_parallel_size * expert_model_parallel_size) != 0:
        raise ValueError(
            f"the {stage_size} ranks of a pipeline stage (tensor {tensor_model_parallel_size} x context "
            f"{context_parallel_size} x data {data_parallel_size} parallel) must be divisible by "
            f"--expert-tensor-parallel-size ({expert_tensor_parallel_size}) x --expert-model-parallel-size "
            f"({expert_model_parallel_size}); choose expert sizes whose product divides it"
        )
    if (data_parallel_size * context_parallel_size) % num_distributed_optimizer_instances != 0:
        raise ValueError(
            f"data-parallel ({data_parallel_size}) x context-parallel ({context_parallel_size}) size must be "
            f"divisible by --num-distributed-optimizer-instances ({num_distributed_optimizer_instances})"
        )
    return data_parallel_size


def generate_rank_groups(world_size, tp=1, pp=1, cp=1, ep=1, dp=None, order=DEFAULT_ORDER,
                         num_distributed_optimizer_instances=1, etp=None):
    """Every kind of rank group for a layout, as {name: [[global ranks], ...]}.

    Names: "tp", "pp", "cp", "dp" (equal tp/pp/cp coordinates), "dp-cp" (equal tp/pp coordinates),
    "tp-cp", "tp-dp" (equal pp/cp coordinates), "tp-dp-cp" (every rank of one pipeline stage: FP8's
    amax-reduction group), "mp" (tp x pp: the model-parallel group), "embedding" (first and last rank of each
    pipeline), "inner-dp-cp" / "outer-dp-cp" (hybrid sharding: the dp-cp group cut into N consecutive chunks, and the
    ranks at the same position across the chunks); on the expert grid (expert tensor-parallel size `etp`, None
    meaning `tp`): "ep", "etp", "expt-dp", "tp-ep" (etp x ep: the token dispatchers' group), "tp-ep-pp"
    (etp x ep x pp: every expert of the model once), and "inner-expt-dp" / "outer-expt-dp" (the same cut of each
    expert-dp group, when N divides its size); with N > 1 instances dividing the expert-dp size,
    "dist-opt-instance" (every rank of one distributed-optimizer instance).
    `dp` is derived from the world size when None; a given value must agree with it.
    """
    etp = tp if etp is None else etp
    derived_dp = validate_parallel_sizes(world_size, tp, pp, cp, ep, num_distributed_optimizer_instances, etp)
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

    expert_dp = (tp * cp * dp) // (etp * ep)
    expert = RankGrid({"tp": etp, "ep": ep, "dp": expert_dp, "pp": pp}, [n for n in names if n != "cp"])
    groups["ep"] = expert.groups({"ep"})
    groups["etp"] = expert.groups({"tp"})
    groups["expt-dp"] = expert.groups({"dp"})
    groups["tp-ep"] = expert.groups({"tp", "ep"})
    groups["tp-ep-pp"] = expert.groups({"tp", "ep", "pp"})
    if expert_dp % instances == 0:
        # Hybrid sharding of expert parameters: the expert-dp group cut into N consecutive chunks (one per
        # distributed-optimizer instance) and the ranks at the same position across the chunks. Absent when the
        # instances do not divide the expert data-parallel size (the expert-side getters then say so).
        expert_inner_size = expert_dp // instances
        groups["inner-expt-dp"] = [ranks[start : start + expert_inner_size] for ranks in groups["expt-dp"]
                                   for start in range(0, len(ranks), expert_inner_size)]
        groups["outer-expt-dp"] = [ranks[position::expert_inner_size] for ranks in groups["expt-dp"]
                                   for position in range(expert_inner_size)]
        if instances > 1:
            # Every rank of one distributed-optimizer instance: N consecutive runs of tp-ep-pp groups (one
            # instance is the whole world).
            per_instance = len(groups["tp-ep-pp"]) // instances
            groups["dist-opt-instance"] = [sum(groups["tp-ep-pp"][start : start + per_instance], [])
                                           for start in range(0, len(groups["tp-ep-pp"]), per_instance)]
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


def hierarchical_context_parallel_groups(cp_groups, hierarchical_sizes):
    """{"hierarchical-cp-<level>": rank lists} for `--hierarchical-context-parallel-sizes` (inner to outer).

    Each context-parallel group is laid out on a grid of the given sizes, level 0 varying fastest: level 0 groups
    are consecutive context-parallel ranks (the all-to-all groups of a2a+p2p), level 1 groups take every
    sizes[0]-th one (the p2p ring across them), as upstream lays them out.
    """
    sizes = list(hierarchical_sizes)
    cp_size = len(cp_groups[0])
    product = 1
    for size in sizes:
        product *= size
    if product != cp_size:
        raise ValueError(f"--hierarchical-context-parallel-sizes {sizes}: the product must equal "
                         f"--context-parallel-size ({cp_size})")
    levels = [f"level{index}" for index in range(len(sizes))]
    grid = RankGrid(dict(zip(levels, sizes)), levels)
    groups = {}
    for index, level in enumerate(levels):
        positions = grid.groups({level})
        groups[f"hierarchical-cp-{index}"] = [[ranks[p] for p in group] for ranks in cp_groups for group in positions]
    return groups

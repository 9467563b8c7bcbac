"""Rank layouts (pure arithmetic, checked against hand-written lists) and the real process groups built from them."""

import pytest
import torch
import torch.distributed as dist

from megatron.core import device_utils
from megatron.core import parallel_state as ps
from tests.unit_tests.multiprocess_harness import run_on_ranks

# --------------------------------------------------------------------------------------------------------
# Pure layouts at world size 8
# --------------------------------------------------------------------------------------------------------


def test_tp2_pp2_dp2_default_order():
    groups = ps.generate_rank_groups(8, tp=2, pp=2)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp-cp"] == groups["dp"]
    assert groups["cp"] == [[r] for r in range(8)]
    assert groups["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert groups["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["ep"] == [[r] for r in range(8)]


def test_tp2_cp2_dp2_with_two_optimizer_instances():
    groups = ps.generate_rank_groups(8, tp=2, cp=2, num_distributed_optimizer_instances=2)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["dp-cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups["tp-cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["inner-dp-cp"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert groups["outer-dp-cp"] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert groups["embedding"] == [[r] for r in range(8)]


def test_pp4_dp2_embedding_is_first_and_last_stage():
    groups = ps.generate_rank_groups(8, pp=4)
    assert groups["pp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups["embedding"] == [[0, 6], [1, 7]]
    assert groups["dp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["tp"] == [[r] for r in range(8)]
    assert groups["mp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_expert_parallel_regroups_data_parallel_ranks():
    groups = ps.generate_rank_groups(8, tp=2, ep=2)
    assert groups["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["expt-dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["tp-ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_expert_tensor_parallel_size_lays_out_its_own_expert_grid():
    # Upstream's expert rank generator: tp=ETP, ep=EP, dp=world/(ETP*EP*PP), order tp-ep-dp-pp.
    groups = ps.generate_rank_groups(8, tp=2, pp=2, ep=2, etp=1)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["etp"] == [[r] for r in range(8)]
    assert groups["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["expt-dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["tp-ep"] == groups["ep"]
    assert groups["tp-ep-pp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    groups = ps.generate_rank_groups(8, tp=2, ep=4, etp=1)
    assert groups["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["expt-dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    groups = ps.generate_rank_groups(8, tp=1, ep=2, etp=2)
    assert groups["tp"] == [[r] for r in range(8)]
    assert groups["etp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["expt-dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["tp-ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # ETP defaults to TP: the expert tensor-parallel groups are the tensor-parallel ones
    groups = ps.generate_rank_groups(8, tp=2, ep=2)
    assert groups["etp"] == groups["tp"]
    assert groups["tp-ep-pp"] == groups["tp-ep"]
    with pytest.raises(ValueError, match="--expert-tensor-parallel-size \\(4\\) x --expert-model-parallel-size"):
        ps.generate_rank_groups(4, tp=2, ep=2, etp=4)


def test_expert_data_parallel_groups_split_into_optimizer_instances():
    groups = ps.generate_rank_groups(8, ep=2, num_distributed_optimizer_instances=2)
    assert groups["inner-dp-cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["expt-dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # each instance's expert-dp ranks are ranks of that instance: expert and dense replicas line up
    assert groups["inner-expt-dp"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert groups["outer-expt-dp"] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    groups = ps.generate_rank_groups(8, tp=2, ep=2, num_distributed_optimizer_instances=2)
    assert groups["expt-dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["inner-expt-dp"] == [[r] for r in (0, 4, 1, 5, 2, 6, 3, 7)]
    assert groups["outer-expt-dp"] == groups["expt-dp"]
    # four instances cannot split an expert-dp group of two: no expert-side hybrid groups
    groups = ps.generate_rank_groups(8, ep=4, num_distributed_optimizer_instances=4)
    assert "inner-expt-dp" not in groups and "outer-expt-dp" not in groups


def test_tp4_dp2_two_instances_gives_singleton_inner_groups():
    groups = ps.generate_rank_groups(8, tp=4, num_distributed_optimizer_instances=2)
    assert groups["dp-cp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["inner-dp-cp"] == [[0], [4], [1], [5], [2], [6], [3], [7]]
    assert groups["outer-dp-cp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_custom_order_puts_pipeline_before_data():
    groups = ps.generate_rank_groups(8, tp=2, pp=2, order="tp-pp-dp")
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["embedding"] == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_amax_reduction_groups_are_the_ranks_of_one_pipeline_stage():
    # TP2 x DP2: every rank holds (a shard or a replica of) the same layers.
    groups = ps.generate_rank_groups(4, tp=2)
    assert groups["tp-dp-cp"] == groups["tp-dp"] == [[0, 1, 2, 3]]
    # TP2 x PP2: one group per stage, the stage's two tensor-parallel ranks.
    groups = ps.generate_rank_groups(4, tp=2, pp=2)
    assert groups["tp-dp-cp"] == groups["tp-dp"] == [[0, 1], [2, 3]]
    # With context parallelism the CP ranks of a stage join (they hold the same layers too) unless left out.
    groups = ps.generate_rank_groups(8, tp=2, pp=2, cp=2)
    assert groups["tp-dp-cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["tp-dp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    groups = ps.generate_rank_groups(8, tp=2, cp=2)
    assert groups["tp-dp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_every_kind_of_group_partitions_the_world():
    groups = ps.generate_rank_groups(8, tp=2, pp=2, cp=2, num_distributed_optimizer_instances=1)
    for name in ("tp", "pp", "cp", "dp", "dp-cp", "mp", "inner-dp-cp", "outer-dp-cp", "ep", "expt-dp", "tp-dp",
                 "tp-dp-cp"):
        flat = sorted(r for ranks in groups[name] for r in ranks)
        assert flat == list(range(8)), name


def test_device_mesh_layout_per_stage():
    groups = ps.generate_rank_groups(8, tp=2, cp=2, num_distributed_optimizer_instances=2)
    assert ps.device_mesh_layout(groups, 5, 2) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    groups = ps.generate_rank_groups(8, tp=2, pp=2)
    assert ps.device_mesh_layout(groups, 0, 1) == [[[0, 1], [2, 3]]]
    assert ps.device_mesh_layout(groups, 7, 1) == [[[4, 5], [6, 7]]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=6, tp=4), r"world size 6 is not divisible by --tensor-model-parallel-size \(4\) x "
         r"--pipeline-model-parallel-size \(1\) x --context-parallel-size \(1\)"),
        (dict(world_size=8, tp=2, pp=3), r"world size 8 is not divisible by --tensor-model-parallel-size \(2\) x "
         r"--pipeline-model-parallel-size \(3\)"),
        (dict(world_size=8, tp=2, num_distributed_optimizer_instances=3), "--num-distributed-optimizer-instances"),
        (dict(world_size=8, tp=2, ep=3), "--expert-model-parallel-size"),
        (dict(world_size=8, tp=0), "--tensor-model-parallel-size must be a positive integer"),
        (dict(world_size=8, tp=2, order="tp-xp-dp"), "unknown dimensions"),
        (dict(world_size=8, tp=2, pp=2, order="tp-dp"), "missing"),
        (dict(world_size=8, tp=2, dp=2), "data-parallel size 2 does not match"),
    ],
)
def test_bad_sizes_raise_value_errors(kwargs, message):
    world_size = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=message):
        ps.generate_rank_groups(world_size, **kwargs)


def test_getters_before_initialisation():
    assert not ps.model_parallel_is_initialized()
    assert ps.get_tensor_model_parallel_world_size() == 1
    assert ps.get_tensor_model_parallel_rank() == 0
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.get_tensor_model_parallel_group()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.get_device_mesh()


# --------------------------------------------------------------------------------------------------------
# Real process groups
# --------------------------------------------------------------------------------------------------------


def _group_ranks(group):
    return dist.get_process_group_ranks(group)


def _check_layout_on_rank(tp, pp, cp, ep, instances):
    """Initialise, compare every getter with the pure layout, exercise the groups, destroy."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        expert_model_parallel_size=ep, num_distributed_optimizer_instances=instances,
    )
    groups = ps.generate_rank_groups(world, tp=tp, pp=pp, cp=cp, ep=ep, num_distributed_optimizer_instances=instances)

    def mine(name):
        return next(ranks for ranks in groups[name] if rank in ranks)

    checks = [
        (ps.get_tensor_model_parallel_group(), "tp", ps.get_tensor_model_parallel_rank(),
         ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_group(), "pp", ps.get_pipeline_model_parallel_rank(),
         ps.get_pipeline_model_parallel_world_size()),
        (ps.get_context_parallel_group(), "cp", ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()),
        (ps.get_data_parallel_group(), "dp", ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
        (ps.get_data_parallel_group(with_context_parallel=True), "dp-cp",
         ps.get_data_parallel_rank(with_context_parallel=True),
         ps.get_data_parallel_world_size(with_context_parallel=True)),
        (ps.get_expert_model_parallel_group(), "ep", ps.get_expert_model_parallel_rank(),
         ps.get_expert_model_parallel_world_size()),
        (ps.get_expert_data_parallel_group(), "expt-dp", ps.get_expert_data_parallel_rank(),
         ps.get_expert_data_parallel_world_size()),
    ]
    for group, name, group_rank, group_size in checks:
        assert _group_ranks(group) == mine(name), name
        assert group_rank == mine(name).index(rank), name
        assert group_size == len(mine(name)), name
    assert _group_ranks(ps.get_model_parallel_group()) == mine("mp")
    assert _group_ranks(ps.get_amax_reduction_group(with_context_parallel=True)) == mine("tp-dp-cp")
    assert _group_ranks(ps.get_amax_reduction_group()) == mine("tp-dp")
    assert ps.get_amax_reduction_group(tp_only_amax_red=True) is ps.get_tensor_model_parallel_group()
    assert _group_ranks(ps.get_inner_data_parallel_group()) == mine("inner-dp-cp")
    assert ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True) is (
        ps.get_inner_data_parallel_group()
    )
    assert ps.get_data_parallel_world_size(True, True) == len(mine("inner-dp-cp"))
    assert _group_ranks(ps.get_outer_data_parallel_group()) == mine("outer-dp-cp")
    assert dist.get_world_size(ps.get_outer_data_parallel_group()) == instances
    if "inner-expt-dp" in groups:
        assert _group_ranks(ps.get_inner_expert_data_parallel_group()) == mine("inner-expt-dp")
        assert ps.get_expert_data_parallel_group(partial_expert_data_parallel=True) is (
            ps.get_inner_expert_data_parallel_group()
        )
        assert ps.get_expert_data_parallel_world_size(True) == len(mine("inner-expt-dp"))
        assert ps.get_expert_data_parallel_rank(True) == mine("inner-expt-dp").index(rank)
        assert _group_ranks(ps.get_outer_expert_data_parallel_group()) == mine("outer-expt-dp")
        assert dist.get_world_size(ps.get_outer_expert_data_parallel_group()) == instances
    else:
        with pytest.raises(ValueError, match=f"--num-distributed-optimizer-instances {instances} does not divide"):
            ps.get_outer_expert_data_parallel_group()
    if any(rank in ranks for ranks in groups["embedding"]):
        assert _group_ranks(ps.get_embedding_group()) == mine("embedding")
        assert ps.is_rank_in_embedding_group()
    else:
        assert not ps.is_rank_in_embedding_group()
        with pytest.raises(RuntimeError, match="belongs to no embedding group"):
            ps.get_embedding_group()

    pipeline = mine("pp")
    stage = pipeline.index(rank)
    assert ps.is_pipeline_first_stage() == (stage == 0)
    assert ps.is_pipeline_last_stage() == (stage == pp - 1)
    assert ps.get_pipeline_model_parallel_next_rank() == pipeline[(stage + 1) % pp]
    assert ps.get_pipeline_model_parallel_prev_rank() == pipeline[(stage - 1) % pp]

    # The groups carry real traffic: the sum of global ranks over the tensor-parallel group.
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=ps.get_tensor_model_parallel_group())
    assert value.item() == sum(mine("tp"))

    mesh = ps.get_device_mesh()
    mesh_info = (tuple(mesh.mesh.shape), mesh.mesh_dim_names, mesh.device_type, mesh.mesh.tolist())
    assert mesh.mesh.tolist() == ps.device_mesh_layout(groups, rank, instances)
    assert _group_ranks(mesh.get_group("tp")) == mine("tp")
    assert _group_ranks(mesh.get_group("dp_shard_cp")) == mine("inner-dp-cp")
    assert _group_ranks(mesh.get_group("dp_outer")) == mine("outer-dp-cp")
    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()
    return mesh_info


def _run_layouts(layouts):
    return [_check_layout_on_rank(*layout) for layout in layouts]


def _reinitialise_and_reject_bad_sizes():
    ps.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    with pytest.raises(RuntimeError, match="already initialised"):
        ps.initialize_model_parallel()
    ps.destroy_model_parallel()
    with pytest.raises(ValueError, match="is not divisible by --tensor-model-parallel-size"):
        ps.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size() + 1)
    with pytest.raises(ValueError, match="--num-distributed-optimizer-instances"):
        ps.initialize_model_parallel(num_distributed_optimizer_instances=dist.get_world_size() + 1)
    assert not ps.model_parallel_is_initialized()
    ps.initialize_model_parallel()
    devices = (device_utils.get_current_device(), device_utils.get_device_for_group(ps.get_data_parallel_group()))
    return ps.get_data_parallel_world_size(), devices


@pytest.mark.parametrize("world_size", [8])
def test_world_8_getters_and_device_mesh(world_size):
    # (tp, pp, cp, ep, num_distributed_optimizer_instances)
    layouts = [(2, 1, 2, 1, 2), (2, 2, 1, 2, 1), (1, 4, 1, 1, 2), (8, 1, 1, 1, 1)]
    results = run_on_ranks(world_size, _run_layouts, layouts)
    for rank, per_layout in enumerate(results):
        (shape_a, names_a, device_a, mesh_a), (shape_b, _, _, mesh_b) = per_layout[:2]
        (shape_c, _, _, _), (shape_d, _, _, _) = per_layout[2:]
        assert names_a == ("dp_outer", "dp_shard_cp", "tp") and device_a == "cpu"
        assert shape_a == (2, 2, 2) and mesh_a == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
        # PP == 2: one mesh per pipeline stage.
        assert shape_b == (1, 2, 2)
        assert mesh_b == ([[[0, 1], [2, 3]]] if rank < 4 else [[[4, 5], [6, 7]]])
        assert shape_c == (2, 1, 1)
        assert shape_d == (1, 1, 8)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_small_worlds(world_size):
    layouts = [(1, 1, 1, 1, 1), (world_size, 1, 1, 1, 1), (1, world_size, 1, 1, 1), (1, 1, world_size, 1, 1),
               (1, 1, 1, world_size, world_size)]
    if world_size == 4:
        layouts += [(2, 2, 1, 1, 1), (2, 1, 1, 2, 2), (1, 1, 1, 2, 2)]
    results = run_on_ranks(world_size, _run_layouts, layouts)
    assert all(mesh_info[0][0] == (1, world_size, 1) for mesh_info in results)
    cpu = torch.device("cpu")
    assert run_on_ranks(world_size, _reinitialise_and_reject_bad_sizes) == [(world_size, (cpu, cpu))] * world_size


def test_device_helpers_follow_the_backend():
    assert device_utils.device_type_for_backend("gloo") == "cpu"
    assert device_utils.device_type_for_backend("nccl") == "cuda"
    assert device_utils.device_type_for_backend("cpu:gloo,cuda:nccl") == "cuda"
    assert device_utils.get_current_device() == torch.device("cpu")  # no process group in this process
    state = device_utils.get_rng_state("cpu")
    first = torch.rand(3)
    device_utils.set_rng_state(state, "cpu")
    assert torch.equal(torch.rand(3), first)
    device_utils.manual_seed_device(3, "cpu")
    assert torch.equal(torch.rand(2), torch.rand(2, generator=torch.Generator().manual_seed(3)))


@pytest.mark.parametrize(
    "backend, option, message",
    [
        ("gloo", dict(use_sharp=True), r"SHARP is an NCCL feature and this world's backend is 'gloo'"),
        ("nccl", dict(use_sharp=True), "NCCL's SHARP support is not implemented yet"),
        ("gloo", dict(sharp_enabled_group="dp"), "sharp_enabled_group='dp'"),
        ("gloo", dict(nccl_communicator_config_path="c.yaml"), r"an NCCL option and this world's backend is 'gloo'"),
        ("nccl", dict(nccl_communicator_config_path="c.yaml"), "nccl_communicator_config_path: not implemented yet"),
        ("nccl", dict(high_priority_stream_groups=["dp"]), "high_priority_stream_groups: not implemented yet"),
        ("nccl", dict(pipeline_model_parallel_comm_backend="gloo"), r"default process group's backend \('nccl'\)"),
        ("gloo", dict(virtual_pipeline_model_parallel_size=0), "must be an integer >= 1"),
        ("gloo", dict(distributed_timeout_minutes=True), "distributed_timeout_minutes must be a positive number"),
    ],
)
def test_options_that_cannot_be_honoured_are_named(backend, option, message):
    with pytest.raises(ValueError, match=message):
        ps.reject_unsupported_options(backend, **option)


def test_options_that_can_be_honoured_pass():
    ps.reject_unsupported_options("gloo", pipeline_model_parallel_comm_backend="gloo")
    ps.reject_unsupported_options("nccl", pipeline_model_parallel_comm_backend="nccl", distributed_timeout_minutes=0.5)
    ps.reject_unsupported_options("gloo", tensor_model_parallel_size=2)
    ps.reject_unsupported_options("gloo", virtual_pipeline_model_parallel_size=2)


def _embedding_group_membership_by_virtual_stage():
    before = ps.is_initialized()
    ps.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    membership = [ps.is_initialized(), ps.is_rank_in_embedding_group(), ps.is_rank_in_embedding_group(True)]
    membership += [ps.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=chunk) for chunk in (0, 1)]
    ps.destroy_model_parallel()
    return before, membership


@pytest.mark.parametrize("world_size", [2])
def test_upstream_is_rank_in_embedding_group_and_is_initialized(world_size):
    # Pipeline rank 0 holds the embedding in chunk 0, rank 1 the output layer in chunk 1.
    assert run_on_ranks(world_size, _embedding_group_membership_by_virtual_stage) == [
        (False, [True, True, True, True, False]),
        (False, [True, True, True, False, True]),
    ]


def test_upstream_setters_build_one_shard_in_a_single_process():
    """Conversion tools set the tensor/pipeline sizes and ranks without process groups and build one shard."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    def init(weight):
        torch.nn.init.normal_(weight, generator=torch.Generator().manual_seed(7))

    config = ModelParallelConfig(use_cpu_initialization=True)
    full = ColumnParallelLinear(3, 8, config=config, init_method=init, bias=False).weight.detach()
    try:
        ps.set_tensor_model_parallel_world_size(2)
        ps.set_tensor_model_parallel_rank(1)
        ps.set_pipeline_model_parallel_world_size(4)
        ps.set_pipeline_model_parallel_rank(3)
        ps.set_expert_model_parallel_world_size(2)
        ps.set_expert_model_parallel_rank(1)
        ps.set_expert_tensor_parallel_world_size(2)
        ps.set_expert_tensor_parallel_rank(0)
        shard = ColumnParallelLinear(3, 8, config=config, init_method=init, bias=False).weight.detach()
        assert torch.equal(shard, full[4:])
        assert (ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()) == (4, 3)
        assert ps.is_pipeline_last_stage() and not ps.is_pipeline_first_stage()
        assert (ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()) == (2, 1)
        assert (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()) == (2, 0)
        with pytest.raises(ValueError, match=r"set_tensor_model_parallel_rank\(-1\): expected a non-negative int"):
            ps.set_tensor_model_parallel_rank(-1)
    finally:
        ps.destroy_model_parallel()
    assert (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()) == (1, 0)
    assert (ps.get_pipeline_model_parallel_world_size(), ps.get_expert_model_parallel_rank()) == (1, 0)


def _memory_buffer_and_optimizer_instance_groups():
    with pytest.raises(RuntimeError, match="call initialize_model_parallel"):
        ps.get_global_memory_buffer()
    assert ps.get_intra_distributed_optimizer_instance_group(check_initialized=False) is None
    result = {}
    for instances in (1, 2):
        ps.initialize_model_parallel(num_distributed_optimizer_instances=instances)
        buffer = ps.get_global_memory_buffer()
        big = buffer.get_tensor((2, 3), torch.float32, "scratch")
        small = buffer.get_tensor((4,), torch.float32, "scratch")
        assert small.data_ptr() == big.data_ptr() and tuple(big.shape) == (2, 3)
        assert ps.get_global_memory_buffer() is buffer
        result[instances] = (dist.get_process_group_ranks(ps.get_intra_distributed_optimizer_instance_group()),
                             dist.get_process_group_ranks(ps.get_inter_distributed_optimizer_instance_group()))
        ps.destroy_model_parallel()
        assert ps._GLOBAL_MEMORY_BUFFER is None
    return result


def test_upstream_memory_buffer_and_distributed_optimizer_instance_groups():
    # One instance spans the world; two instances of DP 2 hold one rank each, exchanging across instances.
    assert run_on_ranks(2, _memory_buffer_and_optimizer_instance_groups) == [
        {1: ([0, 1], [0]), 2: ([0], [0, 1])},
        {1: ([0, 1], [1]), 2: ([1], [0, 1])},
    ]


def test_distributed_optimizer_instance_layout():
    groups = ps.generate_rank_groups(8, tp=2, cp=2, num_distributed_optimizer_instances=2)
    assert groups["dist-opt-instance"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    groups = ps.generate_rank_groups(8, tp=2, pp=2, num_distributed_optimizer_instances=2)
    assert groups["dist-opt-instance"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert "dist-opt-instance" not in ps.generate_rank_groups(8, tp=2)


def _upstream_getter_signatures():
    unset = [ps.get_tensor_model_parallel_group(check_initialized=False),
             ps.get_expert_data_parallel_group(check_initialized=False)]
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                                 expert_model_parallel_size=2, expert_tensor_parallel_size=1,
                                 num_distributed_optimizer_instances=2)
    getters = [ps.get_tensor_model_parallel_group, ps.get_pipeline_model_parallel_group,
               ps.get_context_parallel_group, ps.get_tensor_and_context_parallel_group, ps.get_model_parallel_group,
               ps.get_expert_model_parallel_group, ps.get_expert_tensor_parallel_group,
               ps.get_expert_tensor_and_model_parallel_group, ps.get_expert_tensor_model_pipeline_parallel_group,
               ps.get_embedding_group, ps.get_position_embedding_group, ps.get_expert_data_parallel_group,
               ps.get_tensor_and_data_parallel_group]
    result = {
        "unset": unset,
        "same": all(getter(check_initialized=False) is getter() for getter in getters),
        # Megatron-Core's positional order: (check_initialized, with_context_parallel / partial_expert_dp)
        "tp-dp": _group_ranks(ps.get_tensor_and_data_parallel_group(True, True)),
        "expt-dp": _group_ranks(ps.get_expert_data_parallel_group(True, False)),
        "inner-expt-dp": _group_ranks(ps.get_expert_data_parallel_group(True, True)),
        "expt-dp-gloo": _group_ranks(ps.get_expert_data_parallel_group_gloo()),
        "inner-expt-dp-gloo": _group_ranks(ps.get_expert_data_parallel_group_gloo(partial_expert_data_parallel=True)),
    }
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=4, create_gloo_process_groups=False)
    result["middle-stage-embedding"] = ps.get_embedding_group(check_initialized=False) is None
    with pytest.raises(RuntimeError, match="create_gloo_process_groups=True"):
        ps.get_expert_data_parallel_group_gloo()
    ps.destroy_model_parallel()
    return result


def test_upstream_check_initialized_positional_orders_and_expert_gloo_groups():
    # TP2 x DP2, EP2 with ETP1: expert dp size 2, split over two optimizer instances.
    results = run_on_ranks(4, _upstream_getter_signatures)
    for rank, result in enumerate(results):
        assert result["unset"] == [None, None] and result["same"]
        assert result["tp-dp"] == [0, 1, 2, 3]
        assert result["expt-dp"] == result["expt-dp-gloo"] == [rank % 2, rank % 2 + 2]
        assert result["inner-expt-dp"] == result["inner-expt-dp-gloo"] == [rank]
        assert result["middle-stage-embedding"] == (rank in (1, 2))

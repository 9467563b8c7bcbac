"""Parallel state on the world the tests were launched in, written as Megatron-Core's tests are.

Every rank runs each test body at once and `Utils` sets up the model-parallel state on the launched world:
`torchrun --nproc-per-node 8 -m pytest tests/unit_tests/test_parallel_state_with_utils.py` covers every size
below; a plain `python -m pytest` runs it on a one-rank world and skips the sizes that need more ranks.
Expected layouts follow the default order "tp-cp-ep-dp-pp": tensor-parallel neighbours are consecutive ranks,
pipeline stages are the slowest-varying coordinate.
"""

import pytest
import torch
import torch.distributed as dist

import megatron.core.parallel_state as ps
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from tests.unit_tests.test_utilities import Utils

rank = Utils.rank
world_size = Utils.world_size
SIZES = [1, 2, 4, 8]


def _sum_of_ranks_over(group):
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=group)
    return value.item()


def test_initialize_and_destroy_model_parallel():
    Utils.initialize_model_parallel(tensor_model_parallel_size=world_size)
    assert ps.model_parallel_is_initialized()
    assert dist.get_world_size() == world_size and dist.get_rank() == rank
    assert ps.get_tensor_model_parallel_world_size() == world_size
    assert ps.get_tensor_model_parallel_rank() == rank
    assert ps.get_data_parallel_world_size() == 1
    assert _sum_of_ranks_over(ps.get_tensor_model_parallel_group()) == world_size * (world_size - 1) / 2
    Utils.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()


@pytest.mark.parametrize("tp", SIZES)
def test_tensor_parallel_groups_are_consecutive_ranks(tp):
    if world_size % tp:
        pytest.skip(f"needs a world size divisible by {tp}; this world has {world_size} ranks (launch with "
                    f"torchrun --nproc-per-node {tp} or a multiple of it)")
    Utils.initialize_model_parallel(tensor_model_parallel_size=tp)
    first = rank - rank % tp
    assert ps.get_tensor_model_parallel_rank() == rank % tp
    assert ps.get_tensor_model_parallel_src_rank() == first
    assert ps.get_tensor_model_parallel_global_ranks() == list(range(first, first + tp))
    assert ps.get_data_parallel_world_size() == world_size // tp
    assert ps.get_data_parallel_rank() == rank // tp
    assert ps.get_data_parallel_global_ranks() == list(range(rank % tp, world_size, tp))
    assert _sum_of_ranks_over(ps.get_tensor_model_parallel_group()) == sum(range(first, first + tp))
    Utils.destroy_model_parallel()


@pytest.mark.parametrize("pp", SIZES)
def test_pipeline_stages_are_the_slowest_coordinate(pp):
    if world_size % pp:
        pytest.skip(f"needs a world size divisible by {pp}; this world has {world_size} ranks (launch with "
                    f"torchrun --nproc-per-node {pp} or a multiple of it)")
    Utils.initialize_model_parallel(1, pp)
    stage_size = world_size // pp
    stage = rank // stage_size
    pipeline = list(range(rank % stage_size, world_size, stage_size))
    assert ps.get_pipeline_model_parallel_rank() == stage
    assert ps.is_pipeline_first_stage() == (stage == 0)
    assert ps.is_pipeline_last_stage() == (stage == pp - 1)
    assert ps.get_pipeline_model_parallel_first_rank() == pipeline[0]
    assert ps.get_pipeline_model_parallel_last_rank() == pipeline[-1]
    assert ps.get_pipeline_model_parallel_next_rank() == pipeline[(stage + 1) % pp]
    assert ps.get_pipeline_model_parallel_prev_rank() == pipeline[(stage - 1) % pp]
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None
    if stage in (0, pp - 1):
        assert ps.get_embedding_global_ranks() == sorted({pipeline[0], pipeline[-1]})
    assert ps.is_rank_in_position_embedding_group() == (stage == 0)
    assert _sum_of_ranks_over(ps.get_pipeline_model_parallel_group()) == sum(pipeline)
    Utils.destroy_model_parallel()


def test_positional_order_is_megatron_cores():
    # tensor, pipeline, virtual pipeline, pipeline comm backend, use_sharp, context parallel: in that order.
    Utils.initialize_model_parallel(1, 1, None, pipeline_model_parallel_comm_backend=None)
    Utils.destroy_model_parallel()
    Utils.initialize_distributed()
    ps.initialize_model_parallel(1, 1, None, None, False, world_size)
    assert ps.get_context_parallel_world_size() == world_size
    assert ps.get_tensor_model_parallel_world_size() == 1
    assert ps.get_pipeline_model_parallel_world_size() == 1
    assert _sum_of_ranks_over(ps.get_context_parallel_group()) == world_size * (world_size - 1) / 2
    Utils.destroy_model_parallel()
    Utils.initialize_model_parallel(1, world_size)
    assert ps.get_pipeline_model_parallel_world_size() == world_size
    Utils.destroy_model_parallel()


def test_embedding_ranks_and_gloo_groups_can_be_chosen():
    Utils.initialize_model_parallel(
        pipeline_model_parallel_size=world_size,
        get_embedding_ranks=lambda pp_ranks: [pp_ranks[-1]],
        get_position_embedding_ranks=lambda pp_ranks: list(pp_ranks),
        create_gloo_process_groups=True,
    )
    assert ps.is_rank_in_embedding_group() == (rank == world_size - 1)
    assert ps.is_rank_in_position_embedding_group()
    gloo_group = ps.get_data_parallel_group_gloo()
    assert dist.get_backend(gloo_group) == "gloo"
    assert dist.get_process_group_ranks(gloo_group) == [rank]
    Utils.destroy_model_parallel()

    Utils.initialize_model_parallel(create_gloo_process_groups=False)
    with pytest.raises(RuntimeError, match="create_gloo_process_groups=True"):
        ps.get_data_parallel_group_gloo()
    Utils.destroy_model_parallel()
    with pytest.raises(ValueError, match="get_embedding_ranks"):
        Utils.initialize_model_parallel(get_embedding_ranks=lambda pp_ranks: [world_size])
    ps.destroy_model_parallel()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(virtual_pipeline_model_parallel_size=0), r"virtual_pipeline_model_parallel_size=0: the number of model"),
        (dict(pipeline_model_parallel_comm_backend="ucc"), r"pipeline_model_parallel_comm_backend='ucc'"),
        (dict(hierarchical_context_parallel_sizes=[2, 1]), r"the product must equal --context-parallel-size \(1\)"),
        (dict(hierarchical_context_parallel_sizes=[0, 1]), "must be a list of positive integers"),
        (dict(expert_tensor_parallel_size=world_size + 1), "--expert-tensor-parallel-size"),
        (dict(nccl_communicator_config_path="nccl.yaml"), "nccl_communicator_config_path"),
        (dict(high_priority_stream_groups=["dp"]), "high_priority_stream_groups"),
        (dict(distributed_timeout_minutes=0), "distributed_timeout_minutes must be a positive number"),
    ],
)
def test_options_it_cannot_honour_fail_clearly(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Utils.initialize_model_parallel(**kwargs)
    assert not ps.model_parallel_is_initialized()


def test_sharp_needs_nccl():
    Utils.initialize_distributed()
    expected = "not implemented yet" if dist.get_backend() == "nccl" else "SHARP is an NCCL feature"
    with pytest.raises(ValueError, match=expected):
        Utils.initialize_model_parallel(use_sharp=True)
    assert not ps.model_parallel_is_initialized()


class TestColumnParallelLinearOnTheLaunchedWorld:
    """Set up and torn down per test method, as Megatron-Core's layer tests do."""

    def setup_method(self, method):
        Utils.initialize_model_parallel(tensor_model_parallel_size=world_size)
        model_parallel_cuda_manual_seed(123)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_gathered_output_equals_the_unsharded_product(self):
        config = ModelParallelConfig(tensor_model_parallel_size=world_size)
        layer = ColumnParallelLinear(8, 4 * world_size, config=config, init_method=torch.nn.init.normal_,
                                     bias=False, gather_output=True)
        assert tuple(layer.weight.shape) == (4, 8)
        shards = [torch.empty_like(layer.weight) for _ in range(world_size)]
        dist.all_gather(shards, layer.weight.detach(), group=ps.get_tensor_model_parallel_group())
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(7))
        output, bias = layer(x)
        assert bias is None and tuple(output.shape) == (3, 4 * world_size)
        # Shard-wise and whole-matrix products may round differently (other matmul shapes): fp32 tolerance.
        torch.testing.assert_close(output, x @ torch.cat(shards).t(), rtol=1e-5, atol=1e-5)

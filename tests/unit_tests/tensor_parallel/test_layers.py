"""Tensor-parallel layers against single-rank torch layers built from the same full weights."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.tensor_parallel.tp_helpers import (
    assert_close,
    chunk,
    gather_partitions,
    setup_tensor_parallel,
    shared_randn,
)

IN_FEATURES, OUT_FEATURES = 8, 16


def _normal(std=0.02):
    return lambda tensor: torch.nn.init.normal_(tensor, mean=0.0, std=std)


# --------------------------------------------------------------------------------------------------------
# Forward and backward against nn.Linear / nn.Embedding
# --------------------------------------------------------------------------------------------------------


def _column_parallel_matches_linear():
    config, rank, tp = setup_tensor_parallel()
    weight, bias = shared_randn(OUT_FEATURES, IN_FEATURES, seed=1), shared_randn(OUT_FEATURES, seed=2)
    x, upstream = shared_randn(3, 2, IN_FEATURES, seed=3), shared_randn(3, 2, OUT_FEATURES, seed=4)
    reference = torch.nn.Linear(IN_FEATURES, OUT_FEATURES)
    with torch.no_grad():
        reference.weight.copy_(weight)
        reference.bias.copy_(bias)
    x_reference = x.clone().requires_grad_()
    y_reference = reference(x_reference)
    y_reference.backward(upstream)

    for gather_output, skip_bias_add in [(True, False), (False, False), (False, True)]:
        layer = ColumnParallelLinear(
            IN_FEATURES, OUT_FEATURES, config=config, init_method=_normal(),
            gather_output=gather_output, skip_bias_add=skip_bias_add,
        )
        assert tuple(layer.weight.shape) == (OUT_FEATURES // tp, IN_FEATURES)
        partitioning = (layer.weight.tensor_model_parallel, layer.weight.partition_dim, layer.weight.partition_stride)
        assert partitioning == (True, 0, 1)
        assert layer.bias.tensor_model_parallel and layer.bias.partition_dim == 0
        with torch.no_grad():
            layer.weight.copy_(chunk(weight, 0, rank, tp))
            layer.bias.copy_(chunk(bias, 0, rank, tp))
        x_parallel = x.clone().requires_grad_()
        output, output_bias = layer(x_parallel)
        case = f"gather_output={gather_output} skip_bias_add={skip_bias_add}"
        if skip_bias_add:
            assert output_bias is layer.bias
            output = output + output_bias
        else:
            assert output_bias is None
        if gather_output:
            assert_close(output, y_reference, f"{case} output")
            output.backward(upstream)
        else:
            assert_close(output, chunk(y_reference, -1, rank, tp), f"{case} output")
            output.backward(chunk(upstream, -1, rank, tp))
        assert_close(x_parallel.grad, x_reference.grad, f"{case} input grad")
        assert_close(gather_partitions(layer.weight.grad, 0), reference.weight.grad, f"{case} weight grad")
        assert_close(gather_partitions(layer.bias.grad, 0), reference.bias.grad, f"{case} bias grad")
    return True


def _row_parallel_matches_linear():
    config, rank, tp = setup_tensor_parallel()
    weight, bias = shared_randn(OUT_FEATURES, IN_FEATURES, seed=5), shared_randn(OUT_FEATURES, seed=6)
    x, upstream = shared_randn(3, 2, IN_FEATURES, seed=7), shared_randn(3, 2, OUT_FEATURES, seed=8)
    reference = torch.nn.Linear(IN_FEATURES, OUT_FEATURES)
    with torch.no_grad():
        reference.weight.copy_(weight)
        reference.bias.copy_(bias)
    x_reference = x.clone().requires_grad_()
    y_reference = reference(x_reference)
    y_reference.backward(upstream)

    for input_is_parallel, skip_bias_add in [(True, False), (False, False), (True, True)]:
        layer = RowParallelLinear(
            IN_FEATURES, OUT_FEATURES, config=config, init_method=_normal(),
            input_is_parallel=input_is_parallel, skip_bias_add=skip_bias_add,
        )
        assert tuple(layer.weight.shape) == (OUT_FEATURES, IN_FEATURES // tp)
        assert (layer.weight.tensor_model_parallel, layer.weight.partition_dim) == (True, 1)
        assert layer.bias.tensor_model_parallel is False and tuple(layer.bias.shape) == (OUT_FEATURES,)
        with torch.no_grad():
            layer.weight.copy_(chunk(weight, 1, rank, tp))
            layer.bias.copy_(bias)
        case = f"input_is_parallel={input_is_parallel} skip_bias_add={skip_bias_add}"
        x_input = (chunk(x, -1, rank, tp) if input_is_parallel else x).clone().requires_grad_()
        output, output_bias = layer(x_input)
        if skip_bias_add:
            output = output + output_bias
        assert_close(output, y_reference, f"{case} output")
        output.backward(upstream)
        expected_input_grad = chunk(x_reference.grad, -1, rank, tp) if input_is_parallel else x_reference.grad
        assert_close(x_input.grad, expected_input_grad, f"{case} input grad")
        assert_close(gather_partitions(layer.weight.grad, 1), reference.weight.grad, f"{case} weight grad")
        assert_close(layer.bias.grad, reference.bias.grad, f"{case} bias grad")
    return True


def _vocab_parallel_embedding_matches_embedding():
    config, rank, tp = setup_tensor_parallel()
    vocab, hidden = 16, 6
    table = shared_randn(vocab, hidden, seed=9)
    ids = torch.randint(0, vocab, (4, 5), generator=torch.Generator().manual_seed(10))
    ids[0, :] = torch.tensor([0, vocab - 1, vocab // tp, vocab // tp - 1, 1])  # partition edges
    upstream = shared_randn(4, 5, hidden, seed=11)
    reference = torch.nn.Embedding(vocab, hidden)
    with torch.no_grad():
        reference.weight.copy_(table)
    expected = reference(ids)
    expected.backward(upstream)

    layer = VocabParallelEmbedding(vocab, hidden, init_method=_normal(), config=config)
    assert tuple(layer.weight.shape) == (vocab // tp, hidden)
    assert (layer.vocab_start_index, layer.vocab_end_index) == (rank * vocab // tp, (rank + 1) * vocab // tp)
    with torch.no_grad():
        layer.weight.copy_(chunk(table, 0, rank, tp))
    output = layer(ids)
    assert_close(output, expected, "embedding output")
    output.backward(upstream)
    assert_close(gather_partitions(layer.weight.grad, 0), reference.weight.grad, "embedding weight grad")

    # Sequence-parallel variant: [b, s] ids -> this rank's [s / tp, b, h] chunk of the summed embeddings.
    scattering = VocabParallelEmbedding(vocab, hidden, init_method=_normal(), config=config,
                                        reduce_scatter_embeddings=True)
    with torch.no_grad():
        scattering.weight.copy_(chunk(table, 0, rank, tp))
    ids_for_sequence_split = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(12))
    expected_sequence_first = reference(ids_for_sequence_split).detach().transpose(0, 1)
    assert_close(scattering(ids_for_sequence_split), chunk(expected_sequence_first, 0, rank, tp), "reduce-scattered")
    with pytest.raises(ValueError, match="vocabulary size 15 is not divisible by --tensor-model-parallel-size"):
        VocabParallelEmbedding(15, hidden, init_method=_normal(), config=config)
    return True


def _sequence_parallel_mlp_matches_reference():
    config, rank, tp = setup_tensor_parallel(sequence_parallel=True)
    seq, batch, hidden, ffn = 8, 2, 4, 8
    w1, b1 = shared_randn(ffn, hidden, seed=12), shared_randn(ffn, seed=13)
    w2, b2 = shared_randn(hidden, ffn, seed=14), shared_randn(hidden, seed=15)
    x, upstream = shared_randn(seq, batch, hidden, seed=16), shared_randn(seq, batch, hidden, seed=17)

    reference_in, reference_out = torch.nn.Linear(hidden, ffn), torch.nn.Linear(ffn, hidden)
    with torch.no_grad():
        reference_in.weight.copy_(w1), reference_in.bias.copy_(b1)
        reference_out.weight.copy_(w2), reference_out.bias.copy_(b2)
    x_reference = x.clone().requires_grad_()
    y_reference = reference_out(F.gelu(reference_in(x_reference)))
    y_reference.backward(upstream)

    column = ColumnParallelLinear(hidden, ffn, config=config, init_method=_normal())
    row = RowParallelLinear(ffn, hidden, config=config, init_method=_normal(), input_is_parallel=True)
    assert row.bias.sequence_parallel is True
    with torch.no_grad():
        column.weight.copy_(chunk(w1, 0, rank, tp)), column.bias.copy_(chunk(b1, 0, rank, tp))
        row.weight.copy_(chunk(w2, 1, rank, tp)), row.bias.copy_(b2)
    x_local = chunk(x, 0, rank, tp).clone().requires_grad_()
    hidden_parallel, _ = column(x_local)
    assert tuple(hidden_parallel.shape) == (seq, batch, ffn // tp)
    output, _ = row(F.gelu(hidden_parallel))
    assert tuple(output.shape) == (seq // tp, batch, hidden)
    assert_close(output, chunk(y_reference, 0, rank, tp), "sequence-parallel output")
    output.backward(chunk(upstream, 0, rank, tp))
    assert_close(x_local.grad, chunk(x_reference.grad, 0, rank, tp), "sequence-parallel input grad")
    assert_close(gather_partitions(column.weight.grad, 0), reference_in.weight.grad, "column weight grad")
    assert_close(gather_partitions(column.bias.grad, 0), reference_in.bias.grad, "column bias grad")
    assert_close(gather_partitions(row.weight.grad, 1), reference_out.weight.grad, "row weight grad")
    # Each rank's row-bias gradient covers its sequence chunk: the sum over ranks is the full gradient.
    row_bias_grad = row.bias.grad.clone()
    dist.all_reduce(row_bias_grad)
    assert_close(row_bias_grad, reference_out.bias.grad, "row bias grad")
    with pytest.raises(ValueError, match="input_is_parallel=True"):
        RowParallelLinear(ffn, hidden, config=config, init_method=_normal(), input_is_parallel=False)
    with pytest.raises(ValueError, match="gather_output=True"):
        ColumnParallelLinear(hidden, ffn, config=config, init_method=_normal(), gather_output=True)
    return True


def _run_all_layer_checks():
    from megatron.core import parallel_state as ps

    results = []
    for check in (
        _column_parallel_matches_linear,
        _row_parallel_matches_linear,
        _vocab_parallel_embedding_matches_embedding,
        _sequence_parallel_mlp_matches_reference,
    ):
        results.append(check())
        ps.destroy_model_parallel()
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_layers_match_single_rank_reference(world_size):
    assert run_on_ranks(world_size, _run_all_layer_checks) == [[True] * 4] * world_size


# --------------------------------------------------------------------------------------------------------
# Initialisation: partitions are slices of the single-rank initialisation
# --------------------------------------------------------------------------------------------------------


def _build_layers(config, seed):
    torch.manual_seed(seed)
    column = ColumnParallelLinear(IN_FEATURES, OUT_FEATURES, config=config, init_method=_normal(1.0))
    row = RowParallelLinear(OUT_FEATURES, IN_FEATURES, config=config, init_method=_normal(1.0))
    embedding = VocabParallelEmbedding(16, IN_FEATURES, init_method=_normal(1.0), config=config)
    fused = ColumnParallelLinear(IN_FEATURES, OUT_FEATURES, config=config, init_method=_normal(1.0), stride=2)
    return column, row, embedding, fused


def _partitions_after_seeding(seed):
    config, _, _ = setup_tensor_parallel()
    layers = _build_layers(config, seed)
    next_draw = torch.rand(4)  # the default generator must be in lockstep across ranks afterwards
    return [layer.weight.detach().clone() for layer in layers], next_draw


@pytest.mark.parametrize("world_size", [2, 4])
def test_partitions_are_slices_of_single_rank_init(world_size):
    seed = 1234
    results = run_on_ranks(world_size, _partitions_after_seeding, seed)
    full = [layer.weight.detach() for layer in _build_layers(ModelParallelConfig(), seed)]
    expected_draw = torch.rand(4)
    column_full, row_full, embedding_full, fused_full = full
    for rank, (partitions, next_draw) in enumerate(results):
        column, row, embedding, fused = partitions
        torch.testing.assert_close(column, chunk(column_full, 0, rank, world_size), atol=0, rtol=0)
        torch.testing.assert_close(row, chunk(row_full, 1, rank, world_size), atol=0, rtol=0)
        torch.testing.assert_close(embedding, chunk(embedding_full, 0, rank, world_size), atol=0, rtol=0)
        block = OUT_FEATURES // (2 * world_size)
        expected_fused = torch.cat(
            [fused_full[rank * block : (rank + 1) * block],
             fused_full[(rank + world_size) * block : (rank + world_size + 1) * block]]
        )
        torch.testing.assert_close(fused, expected_fused, atol=0, rtol=0)
        torch.testing.assert_close(next_draw, expected_draw, atol=0, rtol=0)


# --------------------------------------------------------------------------------------------------------
# Single-process behaviour (tensor-parallel size 1)
# --------------------------------------------------------------------------------------------------------


def test_meta_device_then_reset_parameters_reproduces_init():
    config = ModelParallelConfig()
    eager = _build_layers(config, seed=99)
    with torch.device("meta"):
        deferred = _build_layers(config, seed=0)
    assert all(layer.weight.is_meta for layer in deferred)
    torch.manual_seed(99)
    for layer in deferred:
        layer.to_empty(device="cpu")
        layer.reset_parameters()
    for eager_layer, deferred_layer in zip(eager, deferred):
        torch.testing.assert_close(deferred_layer.weight, eager_layer.weight, atol=0, rtol=0)
        if getattr(eager_layer, "bias", None) is not None:
            assert torch.count_nonzero(deferred_layer.bias) == 0


def test_params_dtype_and_perform_initialization():
    config = ModelParallelConfig(bf16=True, params_dtype=torch.bfloat16)
    torch.manual_seed(3)
    layer = ColumnParallelLinear(4, 6, config=config, init_method=_normal(1.0))
    torch.manual_seed(3)
    expected = torch.empty(6, 4).normal_(0.0, 1.0).to(torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16
    torch.testing.assert_close(layer.weight.detach(), expected, atol=0, rtol=0)

    state = torch.get_rng_state()
    ColumnParallelLinear(4, 6, config=ModelParallelConfig(perform_initialization=False), init_method=_normal())
    assert torch.equal(torch.get_rng_state(), state)  # no random numbers consumed


def test_gradient_accumulation_fusion_adds_into_main_grad():
    config = ModelParallelConfig(gradient_accumulation_fusion=True)
    torch.manual_seed(0)
    layer = RowParallelLinear(4, 3, config=config, init_method=_normal(1.0))
    reference = torch.nn.Linear(4, 3)
    with torch.no_grad():
        reference.weight.copy_(layer.weight), reference.bias.copy_(layer.bias)
    x = torch.randn(5, 4)
    reference(x).sum().backward()

    layer.weight.main_grad = torch.zeros(3, 4)
    for _ in range(2):
        layer(x)[0].sum().backward()
    assert layer.weight.grad is None
    torch.testing.assert_close(layer.weight.main_grad, 2 * reference.weight.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.bias.grad, 2 * reference.bias.grad, atol=1e-5, rtol=1e-5)

    layer.weight.grad_added_to_main_grad = False
    layer(x)[0].sum().backward()
    assert layer.weight.grad_added_to_main_grad is True
    assert torch.count_nonzero(layer.weight.grad) == 0
    torch.testing.assert_close(layer.weight.main_grad, 3 * reference.weight.grad, atol=1e-5, rtol=1e-5)


def test_weightless_column_layer_uses_given_weight():
    config = ModelParallelConfig()
    layer = ColumnParallelLinear(4, 6, config=config, init_method=_normal(), bias=False,
                                 skip_weight_param_allocation=True)
    assert layer.weight is None and list(layer.parameters()) == []
    weight = torch.randn(6, 4, requires_grad=True)
    x = torch.randn(2, 4)
    output, _ = layer(x, weight)
    torch.testing.assert_close(output, x @ weight.t(), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="needs forward"):
        layer(x)
    with pytest.raises(ValueError, match="expected"):
        layer(x, torch.randn(5, 4))


# --------------------------------------------------------------------------------------------------------
# Upstream's constructor keywords
# --------------------------------------------------------------------------------------------------------


def _upstream_keywords():
    from megatron.core import parallel_state as ps

    config, rank, tp = setup_tensor_parallel()
    group = ps.get_tensor_model_parallel_group()
    column = ColumnParallelLinear(IN_FEATURES, OUT_FEATURES, config=config, init_method=_normal(1.0), bias=True,
                                  gather_output=False, keep_master_weight_for_test=True, tp_group=group,
                                  embedding_activation_buffer=None, grad_output_buffer=None, disable_grad_reduce=False)
    row = RowParallelLinear(OUT_FEATURES, IN_FEATURES, config=config, init_method=_normal(1.0), bias=True,
                            input_is_parallel=True, skip_bias_add=False, keep_master_weight_for_test=True,
                            tp_group=group)
    embedding = VocabParallelEmbedding(16, IN_FEATURES, init_method=_normal(), config=config, tp_group=group)
    plain = ColumnParallelLinear(IN_FEATURES, OUT_FEATURES, config=config, init_method=_normal())
    refusals = []
    data_parallel_group = ps.get_data_parallel_group()  # this rank alone
    for build in (
        lambda: ColumnParallelLinear(IN_FEATURES, OUT_FEATURES, config=config, init_method=_normal(),
                                     tp_group=data_parallel_group),
        lambda: RowParallelLinear(OUT_FEATURES, IN_FEATURES, config=config, init_method=_normal(),
                                  tp_group=data_parallel_group),
        lambda: ColumnParallelLinear(IN_FEATURES, OUT_FEATURES, config=config, init_method=_normal(),
                                     disable_grad_reduce=True),
        lambda: ColumnParallelLinear(IN_FEATURES, OUT_FEATURES, config=config, init_method=_normal(),
                                     grad_output_buffer=[]),
    ):
        try:
            build()
        except ValueError as error:
            refusals.append(str(error))
    return {
        "rank": rank, "tp": tp, "column": (column.weight.detach(), column.master_weight),
        "row": (row.weight.detach(), row.master_weight), "embedding_rows": embedding.weight.shape[0],
        "plain_master": plain.master_weight, "refusals": refusals,
    }


@pytest.mark.parametrize("world_size", [2])
def test_upstream_constructor_keywords(world_size):
    for result in run_on_ranks(world_size, _upstream_keywords):
        rank, tp = result["rank"], result["tp"]
        column_weight, column_master = result["column"]
        row_weight, row_master = result["row"]
        # keep_master_weight_for_test keeps the full weight this rank's partition was cut from.
        assert column_master.shape == (OUT_FEATURES, IN_FEATURES) and row_master.shape == (IN_FEATURES, OUT_FEATURES)
        torch.testing.assert_close(column_weight, chunk(column_master, 0, rank, tp), atol=0, rtol=0)
        torch.testing.assert_close(row_weight, chunk(row_master, 1, rank, tp), atol=0, rtol=0)
        assert result["plain_master"] is None and result["embedding_rows"] == 16 // tp
        column_group, row_group, grad_reduce, buffer = result["refusals"]
        assert f"ColumnParallelLinear(tp_group=...) spans ranks [{rank}], but the layer is split over the " \
               "tensor-parallel group of parallel_state (ranks [0, 1])" in column_group
        assert row_group.startswith("RowParallelLinear(tp_group=...) spans ranks")
        assert grad_reduce.startswith("ColumnParallelLinear(disable_grad_reduce=...) is not supported here")
        assert buffer.startswith("ColumnParallelLinear(grad_output_buffer=...) is not supported here")


# --------------------------------------------------------------------------------------------------------
# Expert linears (is_expert) and upstream's runtime_gather_output
# --------------------------------------------------------------------------------------------------------


def _expert_and_runtime_gather_layers():
    from megatron.core import parallel_state as ps

    x, upstream = shared_randn(3, 2, IN_FEATURES, seed=3), shared_randn(3, 2, OUT_FEATURES, seed=4)
    weight = shared_randn(OUT_FEATURES, IN_FEATURES, seed=1)
    reference_x = x.clone().requires_grad_()
    reference_y = F.linear(reference_x, weight)
    reference_y.backward(upstream)
    results = {}

    # TP = 2, expert TP = 1: each rank holds whole expert weights and does no communication (the dispatcher's job).
    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_tensor_parallel_size=1)
    config = ModelParallelConfig(tensor_model_parallel_size=2)
    row = RowParallelLinear(IN_FEATURES, OUT_FEATURES, config=config, init_method=_normal(), bias=True,
                            input_is_parallel=True, skip_bias_add=True, is_expert=True)
    column = ColumnParallelLinear(IN_FEATURES, OUT_FEATURES, config=config, init_method=_normal(), bias=False,
                                  is_expert=True)
    for name, layer in (("row", row), ("column", column)):
        with torch.no_grad():
            layer.weight.copy_(weight)
        x_local = x.clone().requires_grad_()
        output, _ = layer(x_local)
        output.backward(upstream)
        assert_close(output, reference_y.detach(), f"{name} etp1 output")
        assert_close(x_local.grad, reference_x.grad, f"{name} etp1 input grad")
    bias_added = RowParallelLinear(IN_FEATURES, OUT_FEATURES, config=config, init_method=_normal(), bias=True,
                                   input_is_parallel=True, skip_bias_add=False, is_expert=True)
    with pytest.raises(ValueError, match=r"RowParallelLinear\(is_expert=True\) .* build it with skip_bias_add=True"):
        bias_added(x)
    ps.destroy_model_parallel()

    # TP = 1, expert TP = 2: the expert linears are split over, and communicate over, the expert TP group.
    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_tensor_parallel_size=2)
    rank, config = ps.get_expert_tensor_parallel_rank(), ModelParallelConfig()
    column = ColumnParallelLinear(IN_FEATURES, OUT_FEATURES, config=config, init_method=_normal(), bias=False,
                                  is_expert=True)
    row = RowParallelLinear(OUT_FEATURES, IN_FEATURES, config=config, init_method=_normal(), bias=False,
                            input_is_parallel=False, is_expert=True)
    with torch.no_grad():
        column.weight.copy_(chunk(weight, 0, rank, 2))
        row.weight.copy_(chunk(weight.t(), 1, rank, 2))
    x_local = x.clone().requires_grad_()
    output, _ = column(x_local, runtime_gather_output=True)
    output.backward(upstream)
    results["column etp2 gathered"] = (output.detach(), x_local.grad)
    y_local = upstream.clone().requires_grad_()
    output, _ = row(y_local)
    output.sum().backward()
    results["row etp2"] = (output.detach(), y_local.grad)
    ps.destroy_model_parallel()
    expected = {
        "column etp2 gathered": (reference_y.detach(), reference_x.grad),
        "row etp2": (F.linear(upstream, weight.t()), torch.ones(3, 2, IN_FEATURES) @ weight.t()),
    }
    for name, (output, grad) in results.items():
        assert_close(output, expected[name][0], f"{name} output")
        assert_close(grad, expected[name][1], f"{name} input grad")
    return True


def test_expert_linears_communicate_over_the_expert_tensor_parallel_group():
    """Upstream's expert linears (`is_expert=True`): under tensor or expert parallelism no communication (here
    TP = 2 with --expert-tensor-parallel-size 1 summed each output twice over the tensor-parallel group); otherwise
    over the expert tensor-parallel group. Also `runtime_gather_output`, upstream's per-call override."""
    assert run_on_ranks(2, _expert_and_runtime_gather_layers) == [True, True]


def _embedding_sharded_state_dict():
    config, rank, tp = setup_tensor_parallel()
    embedding = VocabParallelEmbedding(8 * tp, IN_FEATURES, init_method=_normal(), config=config)
    entries = embedding.sharded_state_dict(prefix="embedding.word_embeddings.")
    assert list(entries) == ["embedding.word_embeddings.weight"]
    (offsets, piece), = entries["embedding.word_embeddings.weight"].pieces
    return tuple(entries["embedding.word_embeddings.weight"].global_shape), tuple(offsets), piece is embedding.weight


def test_vocab_parallel_embedding_has_upstreams_sharded_state_dict():
    """As upstream's VocabParallelEmbedding (and this project's linears): its rows of the whole table."""
    results = run_on_ranks(2, _embedding_sharded_state_dict)
    assert results == [((16, IN_FEATURES), (0, 0), True), ((16, IN_FEATURES), (8, 0), True)]


def test_layers_call_the_linear_function_through_the_layers_module(monkeypatch):
    # modelopt's Megatron plugin wraps `layers.linear_with_grad_accumulation_and_async_allreduce` and expects the
    # column- and row-parallel layers to call the wrapped function.
    from megatron.core.tensor_parallel import layers

    original = layers.linear_with_grad_accumulation_and_async_allreduce
    calls = []

    def doubling_linear(input_, weight, bias, *args, **kwargs):
        calls.append(tuple(weight.shape))
        return 2 * original(input_, weight, bias, *args, **kwargs)

    monkeypatch.setattr(layers, "linear_with_grad_accumulation_and_async_allreduce", doubling_linear)
    config = ModelParallelConfig()
    column = ColumnParallelLinear(4, 6, config=config, init_method=_normal(), bias=False)
    row = RowParallelLinear(6, 4, config=config, init_method=_normal(), bias=False, input_is_parallel=True)
    x = torch.randn(2, 4)
    hidden, _ = column(x)
    output, _ = row(hidden)
    assert calls == [(6, 4), (4, 6)]
    torch.testing.assert_close(hidden, 2 * x @ column.weight.t())
    torch.testing.assert_close(output, 2 * hidden @ row.weight.t())

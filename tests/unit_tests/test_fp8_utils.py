"""megatron.core.fp8_utils: quantization error bounds per format, delayed-scaling histories, recipes and
contexts, and ranks agreeing on one scale for tensors they share; and the other names upstream's module exports
(`Fp8Recipe` the enum, `get_fp8_align_size`, `dequantize_fp8_tensor`, `modify_underlying_storage`,
`correct_amax_history_if_needed`, `prepare_model_for_fp8_inference`, and `quantize_param_shard`, which has no
FP8 parameters to write into here and says so)."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from megatron.core import fp8_utils
from megatron.core.fp8.scaling import LinearScaling, ScalingState, reduce_and_record_amaxes
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.multiprocess_harness import run_on_ranks

# Mantissa bits and smallest normal of each float8 dtype: a normal value rounds to nearest with a relative
# error of at most 2**-(mantissa_bits + 1); below the normal range the absolute error is at most half the
# subnormal spacing 2**(min_normal_exponent - mantissa_bits - 1).
FORMAT_FACTS = {
    torch.float8_e4m3fn: {"mantissa_bits": 3, "min_normal_exponent": -6},
    torch.float8_e5m2: {"mantissa_bits": 2, "min_normal_exponent": -14},
}


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_round_trip_error_is_within_the_format_bound(dtype):
    facts = FORMAT_FACTS[dtype]
    values = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3.0
    values = torch.cat([values, torch.logspace(-9, 0, 64) * 3.0])  # reaches into the subnormal range
    quantized = fp8_utils.quantize_with_current_scale(values, dtype)
    assert quantized.data.dtype == dtype and fp8_utils.is_float8tensor(quantized)
    scale = float(quantized.scale)
    assert scale == pytest.approx(fp8_utils.fp8_max(dtype) / values.abs().max().item(), rel=1e-6)
    restored = fp8_utils.dequantize(quantized)
    scaled = values.abs() * scale
    normal = scaled >= 2.0 ** facts["min_normal_exponent"]
    relative_error = ((restored - values).abs() / values.abs())[normal]
    assert relative_error.max().item() <= 2.0 ** -(facts["mantissa_bits"] + 1) + 1e-7
    subnormal_step = 2.0 ** (facts["min_normal_exponent"] - facts["mantissa_bits"])
    assert (~normal).sum() > 0
    assert ((restored - values).abs()[~normal] * scale).max().item() <= subnormal_step / 2 + 1e-9
    # The largest element maps onto the format's maximum exactly; re-quantizing gives the same bytes.
    assert restored.abs().max().item() == pytest.approx(values.abs().max().item(), rel=1e-6)
    again = fp8_utils.quantize(restored, dtype, quantized.scale)
    assert torch.equal(again.data.view(torch.uint8), quantized.data.view(torch.uint8))


def test_scale_margin_saturation_and_zero_amax():
    e4m3 = torch.float8_e4m3fn
    assert float(fp8_utils.scale_from_amax(torch.tensor(2.0), e4m3)) == 224.0
    assert float(fp8_utils.scale_from_amax(torch.tensor(2.0), e4m3, margin=2)) == 56.0
    assert float(fp8_utils.scale_from_amax(torch.tensor(0.0), e4m3)) == 1.0
    assert float(fp8_utils.scale_from_amax(torch.tensor(float("inf")), e4m3)) == 1.0
    saturated = fp8_utils.quantize(torch.tensor([1000.0, -1000.0, 1.0]), e4m3, torch.tensor(1.0))
    assert saturated.dequantize().tolist() == [448.0, -448.0, 1.0]
    assert fp8_utils.quantize_with_current_scale(torch.zeros(3), e4m3).dequantize().tolist() == [0.0, 0.0, 0.0]
    assert not fp8_utils.is_float8tensor(torch.zeros(2, dtype=e4m3))
    with pytest.raises(ValueError, match="quantize needs a float8 dtype"):
        fp8_utils.quantize(torch.zeros(2), torch.float16, torch.tensor(1.0))


def test_formats_and_recipe_validation():
    assert fp8_utils.get_fp8_format("e4m3").backward_dtype == torch.float8_e4m3fn
    hybrid = fp8_utils.get_fp8_format("hybrid")
    assert (hybrid.forward_dtype, hybrid.backward_dtype) == (torch.float8_e4m3fn, torch.float8_e5m2)
    with pytest.raises(ValueError, match="--fp8-format must be one of"):
        fp8_utils.get_fp8_format("e5m2")
    for gpu_only in ("mxfp8", "blockwise"):
        with pytest.raises(ValueError, match=f"--fp8-recipe {gpu_only} needs Transformer Engine on a GPU"):
            fp8_utils.Fp8RecipeSettings(hybrid, scaling=gpu_only)
    with pytest.raises(ValueError, match="--fp8-amax-compute-algo"):
        fp8_utils.Fp8RecipeSettings(hybrid, amax_compute_algo="mean")


def _history_scales(algo):
    recipe = fp8_utils.Fp8RecipeSettings(fp8_utils.get_fp8_format("e4m3"), "delayed", amax_history_len=3,
                                         amax_compute_algo=algo)
    state = ScalingState(recipe, torch.float8_e4m3fn, sharded_over_tensor_parallel=False)
    scales = []
    for peak in (1.0, 4.0, 2.0, 0.5, 0.25):
        scales.append(float(state.scale_for(torch.tensor([peak, -peak / 2]))))
        reduce_and_record_amaxes([state], groups=[])
    return scales, state.amax_history.tolist()


def test_delayed_scaling_reads_the_amax_history():
    # Scale = 448 / amax. Step 1 has no history and uses its own amax; later steps read the history only.
    scales, history = _history_scales("most_recent")
    assert scales == [448.0, 448.0, 112.0, 224.0, 896.0]
    assert history == [0.25, 0.5, 2.0]
    scales, history = _history_scales("max")  # max over the last 3 recorded amaxes
    assert scales == [448.0, 448.0, 112.0, 112.0, 112.0]
    assert history == [0.25, 0.5, 2.0]


def _config(**overrides):
    base = dict(num_layers=4, hidden_size=8, num_attention_heads=2, fp8="hybrid")
    return TransformerConfig(**{**base, **overrides})


def test_config_validation_and_fp8_context():
    assert isinstance(fp8_utils.get_fp8_context(_config(fp8=None)), contextlib.nullcontext)
    config = _config(first_last_layers_bf16=True, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=2)
    in_fp8 = [not fp8_utils.is_first_last_bf16_layer(config, layer) for layer in range(4)]
    assert in_fp8 == [False, True, False, False]
    contexts = [fp8_utils.get_fp8_context(config, layer) for layer in range(4)]
    assert [isinstance(c, fp8_utils.Fp8Region) for c in contexts] == in_fp8
    with contexts[1] as region:
        assert fp8_utils.active_fp8_region() is region
        assert region.recipe.fp8_format.backward_dtype == torch.float8_e5m2
    assert fp8_utils.active_fp8_region() is None
    with pytest.raises(ValueError, match="--fp8-recipe mxfp8 needs Transformer Engine on a GPU"):
        _config(fp8_recipe="mxfp8")
    with pytest.raises(ValueError, match="--fp8-param-gather needs FP8 training"):
        _config(fp8=None, fp8_param=True)
    with pytest.raises(ValueError, match=r"--num-layers-at-end-in-bf16 must be in \[0, --num-layers=4\]"):
        _config(first_last_layers_bf16=True, num_layers_at_end_in_bf16=5)
    with pytest.raises(ValueError, match="use --fp8-recipe tensorwise"):
        _config(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    _config(fp8_recipe="tensorwise", recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


# ---- ranks agree on scales -----------------------------------------------------------------------------------


def _scales_on_ranks():
    import torch.distributed as dist

    from megatron.core import parallel_state

    rank = dist.get_rank()
    results = {}
    hybrid = fp8_utils.get_fp8_format("hybrid")
    # TP=2: each rank holds a different shard; tensorwise scaling reduces the amax over the TP group.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    shard = torch.full((4,), 1.0 + 3.0 * rank)  # amax 1 on rank 0, 4 on rank 1
    tensorwise = LinearScaling(fp8_utils.Fp8RecipeSettings(hybrid, "tensorwise"), "column")
    results["weight_scale_tp"] = float(tensorwise.weight.scale_for(shard))
    results["input_scale_replicated"] = float(tensorwise.input.scale_for(shard))  # not sharded: own amax
    parallel_state.destroy_model_parallel()

    # DP=2, delayed: pending amaxes are reduced over the data-parallel group once per step.
    parallel_state.initialize_model_parallel()
    recipe = fp8_utils.Fp8RecipeSettings(hybrid, "delayed", amax_history_len=2)
    scaling = LinearScaling(recipe, "column")
    with fp8_utils.Fp8Region(recipe):
        scaling.input.scale_for(torch.full((3,), 2.0 + rank))
        scaling.weight.scale_for(torch.full((3,), 0.5))
    reduce_and_record_amaxes(scaling.states(), fp8_utils.amax_reduction_groups())
    results["histories"] = [state.amax_history.tolist() for state in scaling.states()]
    results["next_input_scale"] = float(scaling.input.scale_for(torch.ones(1)))
    return results


def test_ranks_sharing_a_tensor_agree_on_its_scale():
    results = run_on_ranks(2, _scales_on_ranks)
    assert [r["weight_scale_tp"] for r in results] == [448.0 / 4.0] * 2
    assert [r["input_scale_replicated"] for r in results] == [448.0, 448.0 / 4.0]
    # Input amaxes 2 and 3 reduce to 3 on both ranks; no gradient amax was recorded yet.
    assert [r["histories"] for r in results] == [[[3.0, 0.0], [0.5, 0.0], [0.0, 0.0]]] * 2
    assert results[0]["next_input_scale"] == results[1]["next_input_scale"] == pytest.approx(448.0 / 3.0, rel=1e-6)


def _delayed_scales_over_the_amax_reduction_group():
    """At TP2 x DP2 and TP2 x PP2 (world 4): delayed-scaling amaxes reduced at the step's end, and the group
    Transformer Engine's autocast is given (through a stand-in `transformer_engine.pytorch` module that records
    its arguments: TE itself does not run here)."""
    import sys
    import types

    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.core.extensions import transformer_engine as te_backend
    from megatron.core.fp8.scaling import amax_reduction_group, amax_reduction_groups

    rank = dist.get_rank()
    hybrid = fp8_utils.get_fp8_format("hybrid")
    results = {}
    for name, sizes in (("tp2_dp2", {"tensor_model_parallel_size": 2}),
                        ("tp2_pp2", {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2})):
        parallel_state.initialize_model_parallel(**sizes)
        group = parallel_state.get_amax_reduction_group(with_context_parallel=True)
        recipe = fp8_utils.Fp8RecipeSettings(hybrid, "delayed", amax_history_len=2)
        scaling = LinearScaling(recipe, "column")
        with fp8_utils.Fp8Region(recipe):
            scaling.input.scale_for(torch.full((3,), 1.0 + rank))  # amaxes 1, 2, 3, 4
            scaling.weight.scale_for(torch.full((3,), 0.5 * (4 - rank)))  # amaxes 2, 1.5, 1, 0.5
        reduce_and_record_amaxes(scaling.states(), amax_reduction_groups())

        recorded = {}
        stand_in = types.SimpleNamespace(autocast=lambda **kwargs: recorded.update(kwargs))
        saved = {key: sys.modules.get(key) for key in ("transformer_engine", "transformer_engine.pytorch")}
        saved_require, saved_recipe = te_backend.require_transformer_engine, te_backend.te_recipe
        sys.modules["transformer_engine"] = types.SimpleNamespace(pytorch=stand_in)
        sys.modules["transformer_engine.pytorch"] = stand_in
        te_backend.require_transformer_engine, te_backend.te_recipe = (lambda: None), (lambda config: "recipe")
        try:
            te_backend.te_fp8_context(None)
        finally:
            te_backend.require_transformer_engine, te_backend.te_recipe = saved_require, saved_recipe
            for key, module in saved.items():
                if module is None:
                    sys.modules.pop(key, None)
                else:
                    sys.modules[key] = module
        results[name] = {
            "group": dist.get_process_group_ranks(group),
            "native_uses_it": amax_reduction_groups() == [group] and amax_reduction_group() is group,
            "te_gets_it": recorded.get("amax_reduction_group") is group,
            "histories": [state.amax_history.tolist() for state in scaling.states()],
            "next_weight_scale": float(scaling.weight.scale_for(torch.ones(1))),
        }
        parallel_state.destroy_model_parallel()
    return results


@pytest.mark.parametrize("world_size", [4])
def test_delayed_scaling_reduces_amaxes_over_the_stage_amax_reduction_group(world_size):
    results = run_on_ranks(world_size, _delayed_scales_over_the_amax_reduction_group)
    for rank, result in enumerate(results):
        for layout in ("tp2_dp2", "tp2_pp2"):
            assert result[layout]["native_uses_it"] and result[layout]["te_gets_it"], (rank, layout)
        # TP2 x DP2: one group of all four ranks; every shard and replica records the same amaxes.
        assert result["tp2_dp2"]["group"] == [0, 1, 2, 3]
        assert result["tp2_dp2"]["histories"] == [[4.0, 0.0], [2.0, 0.0], [0.0, 0.0]]
        assert result["tp2_dp2"]["next_weight_scale"] == 448.0 / 2.0
        # TP2 x PP2: one group per stage (ranks 0-1 and 2-3), and the stages' amaxes stay apart.
        stage_ranks, input_amax, weight_amax = ([0, 1], 2.0, 2.0) if rank < 2 else ([2, 3], 4.0, 1.0)
        assert result["tp2_pp2"]["group"] == stage_ranks
        assert result["tp2_pp2"]["histories"] == [[input_amax, 0.0], [weight_amax, 0.0], [0.0, 0.0]]
        assert result["tp2_pp2"]["next_weight_scale"] == 448.0 / weight_amax


# ---- upstream's other fp8_utils names ----------------------------------------------------------------------------


def test_fp8_recipe_is_the_enum_of_recipe_names():
    from megatron.core.enums import Fp8Recipe

    assert fp8_utils.Fp8Recipe is Fp8Recipe
    assert fp8_utils.Fp8Recipe.delayed == "delayed" and fp8_utils.Fp8Recipe.tensorwise.value == "tensorwise"
    # The run's settings keep their own name and read the enum member as its name.
    settings = fp8_utils.Fp8RecipeSettings(fp8_utils.get_fp8_format("hybrid"), str(fp8_utils.Fp8Recipe.tensorwise))
    assert settings.scaling == "tensorwise" and not settings.is_delayed


def test_get_fp8_align_size():
    recipe = fp8_utils.Fp8Recipe
    assert [fp8_utils.get_fp8_align_size(member) for member in (recipe.delayed, recipe.tensorwise, recipe.blockwise,
                                                                  recipe.mxfp8)] == [16, 16, 16, 32]
    assert fp8_utils.get_fp8_align_size("mxfp8") == 32 and fp8_utils.get_fp8_align_size("delayed") == 16
    with pytest.raises(ValueError, match=r"fp8_recipe \(--fp8-recipe\) must be one of"):
        fp8_utils.get_fp8_align_size(recipe.custom)


def test_dequantize_fp8_tensor_returns_the_scaled_value():
    values = torch.tensor([[0.5, -3.0], [2.0, 0.25]])
    quantized = fp8_utils.quantize(values, torch.float8_e4m3fn, torch.tensor(64.0))
    restored = fp8_utils.dequantize_fp8_tensor(quantized)
    assert restored.dtype == torch.float32 and torch.equal(restored, values)  # all on the e4m3 grid at scale 64
    with pytest.raises(TypeError, match="fp8_tensor must be a ScaledFloat8"):
        fp8_utils.dequantize_fp8_tensor(values.to(torch.float8_e4m3fn))


@pytest.mark.parametrize("raw_dtype", [torch.uint8, torch.float8_e4m3fn])
def test_modify_underlying_storage_moves_the_bytes_into_a_buffer(raw_dtype):
    values = torch.tensor([[0.5, -3.0, 1.5], [2.0, 0.25, -0.75]])
    quantized = fp8_utils.quantize(values, torch.float8_e4m3fn, torch.tensor(16.0))
    buffer = torch.zeros(10, dtype=raw_dtype)
    fp8_utils.modify_underlying_storage(quantized, buffer[2:8])
    assert quantized.data.data_ptr() == buffer[2:8].data_ptr() and quantized.shape == (2, 3)
    assert torch.equal(quantized.dequantize(), values)
    assert buffer.view(torch.uint8)[[0, 1, 8, 9]].tolist() == [0, 0, 0, 0]
    buffer.view(torch.uint8)[2] = 0  # writes into the buffer are writes into the tensor
    assert quantized.dequantize()[0, 0].item() == 0.0
    with pytest.raises(ValueError, match="new_raw_data must be contiguous with 6 elements"):
        fp8_utils.modify_underlying_storage(quantized, torch.zeros(5, dtype=torch.uint8))
    with pytest.raises(TypeError, match="new_raw_data must be uint8"):
        fp8_utils.modify_underlying_storage(quantized, torch.zeros(6))
    with pytest.raises(TypeError, match="tensor must be a ScaledFloat8"):
        fp8_utils.modify_underlying_storage(values, torch.zeros(6, dtype=torch.uint8))


def _delayed_layer():
    from megatron.core.extensions.transformer_engine import layer_classes
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, fp8="hybrid",
                               fp8_recipe="delayed", fp8_amax_history_len=4)
    torch.manual_seed(0)
    layer = layer_classes(config)[0](16, 32, config=config, init_method=torch.nn.init.normal_, bias=True)
    return layer, config


def test_correct_amax_history_if_needed_leaves_the_histories_as_recorded():
    layer, config = _delayed_layer()
    for step in range(2):
        with fp8_utils.get_fp8_context(config, layer_no=0):
            out, _ = layer(torch.randn(5, 16) * (step + 1))
        out.sum().backward()
        fp8_utils.reduce_fp8_amaxes([layer])
    history = layer.fp8_amax_history.clone()
    assert history[:, :2].min() > 0
    assert fp8_utils.correct_amax_history_if_needed([layer]) is None
    fp8_utils.correct_amax_history_if_needed(layer)
    assert torch.equal(layer.fp8_amax_history, history)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module or a list of them"):
        fp8_utils.correct_amax_history_if_needed("model")


def test_quantize_param_shard_refuses_and_names_the_fp8_param_gather_path():
    fp8_utils.quantize_param_shard([], [], [], None)  # nothing to quantize
    weight = torch.nn.Parameter(torch.ones(4))
    with pytest.raises(NotImplementedError, match="--fp8-param-gather"):
        fp8_utils.quantize_param_shard([weight], [torch.ones(2)], [0], None)


def test_prepare_model_for_fp8_inference_runs_any_length_in_fp8():
    layer, config = _delayed_layer()
    assert fp8_utils.prepare_model_for_fp8_inference(layer) is layer
    x = torch.randn(7, 16)  # 7 tokens: a GPU's FP8 GEMM of them is zero-padded to 16 rows by the layer itself
    with torch.no_grad(), fp8_utils.get_fp8_context(config, layer_no=0):
        out, _ = layer(x)
    reference = x @ layer.weight.t() + layer.bias
    assert out.shape == (7, 32) and not torch.equal(out, reference)  # it did run in FP8
    torch.testing.assert_close(out, reference, rtol=0.15, atol=0.5)
    te_model = torch.nn.Module()
    te_model.config = SimpleNamespace(fp8="hybrid", transformer_impl="transformer_engine")
    with pytest.raises(NotImplementedError, match="--transformer-impl local"):
        fp8_utils.prepare_model_for_fp8_inference(te_model)

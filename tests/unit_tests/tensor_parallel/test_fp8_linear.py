"""FP8 column- and row-parallel linear layers (torch-native backend) at TP=2, and the FP8 linear's GEMM paths.

References: (1) the same two layers written out from the FP8 definitions (`tests/unit_tests/fp8/fp8_reference.py`:
per-tensor scale max/amax over the *full* tensors, saturation, round-to-nearest-even onto the e4m3 / e5m2 grids
computed from frexp) with fp64 GEMMs: the FP8 layers must equal it up to fp32 arithmetic, which shows that the TP
shards agreed on one scale and that every GEMM, forward and backward, saw FP8 operands; (2) the plain fp32
layers, within the error FP8 rounding allows; (3) `torch._scaled_mm` against dequantize-and-matmul emulation.
"""

import logging

import pytest
import torch

from megatron.core import fp8_utils
from megatron.core.fp8 import linear as fp8_linear_module
from tests.unit_tests.fp8.fp8_reference import reference_linear
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.tensor_parallel.tp_helpers import chunk, gather_partitions, setup_tensor_parallel, shared_randn

# fp32 arithmetic (scale reciprocal, fp32 products and sums of <= 24 terms of size ~1) against fp64 GEMMs of the
# same FP8 operands: relative differences of a few 2**-24.
EXACT_RTOL, EXACT_ATOL = 1e-5, 1e-5
# FP8 against fp32 (relative Frobenius error): e4m3 rounds each operand with a relative error of at most
# 2**-4 (RMS about 2**-4 / sqrt(3) = 0.036), e5m2 at most 2**-3; a product of two rounded operands and two
# chained layers stay near 0.07 forward and 0.1 backward for random data. Bounds leave ~2x headroom.
FORWARD_FP8_BOUND = 0.12
BACKWARD_FP8_BOUND = 0.2


def _reference_pair(x, w1, b1, w2, b2, grad, fmt):
    """row(column(x)) forward and backward from the FP8 definitions (fp64 GEMMs). The hidden activation and the
    gradient between the layers are rounded to fp32, as the layers hand them on."""
    f, b = fmt.forward_dtype, fmt.backward_dtype
    x2, g2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
    hidden = reference_linear(x2, w1, b1, None, f, b)[0].to(torch.float32)
    out, grad_hidden, grad_w2, grad_b2 = reference_linear(hidden, w2, b2, g2, f, b)
    grad_hidden = grad_hidden.to(torch.float32)
    _, grad_x, grad_w1, grad_b1 = reference_linear(x2, w1, b1, grad_hidden, f, b)
    as32 = lambda t: t.to(torch.float32)  # noqa: E731
    return (as32(out).view(x.shape[:-1] + (out.shape[-1],)), as32(grad_x).view(x.shape), as32(grad_w1),
            as32(grad_b1), as32(grad_w2), as32(grad_b2))


def _relative_error(actual, expected):
    return ((actual - expected).norm() / expected.norm()).item()


def _run_pair(column, row, x, grad, recipe=None):
    """row(column(x)) forward and backward (inside an FP8 region when `recipe` is given)."""
    x = x.clone().requires_grad_(True)
    for param in (*column.parameters(), *row.parameters()):
        param.grad = None
    if recipe is None:
        hidden, _ = column(x)
        out, _ = row(hidden)
    else:
        with fp8_utils.Fp8Region(recipe):
            hidden, _ = column(x)
            out, _ = row(hidden)
    out.backward(grad)
    return out.detach(), x.grad, column.weight.grad, column.bias.grad, row.weight.grad, row.bias.grad


def _fp8_linear_on_ranks(fmt_name):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    config, tp_rank, tp_size = setup_tensor_parallel()
    torch.manual_seed(7)
    init = torch.nn.init.normal_
    column = ColumnParallelLinear(16, 24, config=config, init_method=lambda w: init(w, std=0.3), bias=True)
    row = RowParallelLinear(24, 16, config=config, init_method=lambda w: init(w, std=0.3), bias=True,
                            input_is_parallel=True)
    with torch.no_grad():
        column.bias.copy_(chunk(shared_randn(24, seed=3), 0, tp_rank, tp_size))
        row.bias.copy_(shared_randn(16, seed=4))
    x = shared_randn(5, 3, 16, seed=1)
    grad = shared_randn(5, 3, 16, seed=2)
    fmt = fp8_utils.get_fp8_format(fmt_name)
    recipe = fp8_utils.Fp8RecipeSettings(fmt, "tensorwise")
    results = {}

    with fp8_utils.force_fp8_scaled_mm():  # on the CPU the default is emulation: run torch's kernel here
        fp8 = _run_pair(column, row, x, grad, recipe)
    fp32 = _run_pair(column, row, x, grad)
    emulated = _run_pair(column, row, x, grad, recipe)  # the CPU default

    # Reference on the full weights, from the FP8 definitions.
    w1 = gather_partitions(column.weight.detach(), 0)
    b1 = gather_partitions(column.bias.detach(), 0)
    w2 = gather_partitions(row.weight.detach(), 1)
    full = _reference_pair(x, w1, b1, w2, row.bias.detach(), grad, fmt)
    reference = (full[0], full[1], chunk(full[2], 0, tp_rank, tp_size), chunk(full[3], 0, tp_rank, tp_size),
                 chunk(full[4], 1, tp_rank, tp_size), full[5])
    names = ("output", "input grad", "column weight grad", "column bias grad", "row weight grad", "row bias grad")
    for name, actual, expected, emulated_value in zip(names, fp8, reference, emulated):
        torch.testing.assert_close(actual, expected, rtol=EXACT_RTOL, atol=EXACT_ATOL, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(actual, emulated_value, rtol=EXACT_RTOL, atol=EXACT_ATOL,
                                   msg=lambda m: f"{name} scaled_mm vs emulation: {m}")
    results["errors_vs_fp32"] = {name: _relative_error(a, e) for name, a, e in zip(names, fp8, fp32)}
    results["grad_dtype"] = str(column.fp8_scaling(recipe).grad_output.dtype)

    # Gradient-accumulation fusion: the FP8 weight gradient is added into main_grad instead of .grad.
    fused_config = type(config)(tensor_model_parallel_size=tp_size, gradient_accumulation_fusion=True)
    fused = ColumnParallelLinear(16, 24, config=fused_config, init_method=lambda w: w, bias=False)
    with torch.no_grad():
        fused.weight.copy_(column.weight)
    fused.weight.main_grad = torch.full_like(fused.weight, 1.0)
    x_plain = x.clone()
    with fp8_utils.Fp8Region(recipe):
        out_fused, _ = fused(x_plain)
    out_fused.backward(torch.ones_like(out_fused))
    column.weight.grad = None
    with fp8_utils.Fp8Region(recipe):
        out_plain, _ = column(x_plain)
    (out_plain - column.bias).backward(torch.ones_like(out_plain))
    assert fused.weight.grad is None
    torch.testing.assert_close(fused.weight.main_grad - 1.0, column.weight.grad, rtol=EXACT_RTOL, atol=EXACT_ATOL)
    return results


@pytest.mark.parametrize("fmt_name", ["e4m3", "hybrid"])
def test_fp8_linear_matches_the_fp8_definition_and_tracks_fp32(fmt_name):
    results = run_on_ranks(2, _fp8_linear_on_ranks, fmt_name)
    expected_grad_dtype = "torch.float8_e5m2" if fmt_name == "hybrid" else "torch.float8_e4m3fn"
    for rank_results in results:
        assert rank_results["grad_dtype"] == expected_grad_dtype
        errors = rank_results["errors_vs_fp32"]
        assert errors["output"] < FORWARD_FP8_BOUND, errors
        for name in ("input grad", "column weight grad", "row weight grad"):
            assert 1e-3 < errors[name] < BACKWARD_FP8_BOUND, errors  # FP8 really in effect, and close
        assert errors["output"] > 1e-3, errors


def _fp8_layer_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**{**dict(num_layers=1, hidden_size=8, num_attention_heads=2, fp8="e4m3",
                                       fp8_amax_history_len=4), **overrides})


def _transformer_layer_column(config, **kwargs):
    """A column-parallel linear built as transformer layers build theirs (FP8-region capable)."""
    from megatron.core.extensions.transformer_engine import layer_classes

    return layer_classes(config)[0](8, 8, config=config, **kwargs)


def test_delayed_scaling_histories_are_module_buffers_and_reduced_once_per_step():
    from megatron.core import parallel_state

    assert not parallel_state.model_parallel_is_initialized()
    config = _fp8_layer_config()
    layer = _transformer_layer_column(config, init_method=torch.nn.init.ones_, bias=False)
    assert layer.state_dict()["fp8_amax_history"].shape == (3, 4)
    x = torch.full((2, 8), 0.5, requires_grad=True)
    for _ in range(2):  # two steps of two microbatches: the amaxes of a step are recorded once, at its end
        for _ in range(2):
            with fp8_utils.get_fp8_context(config, layer_no=0):
                out, _ = layer(x)
            out.sum().backward()
        fp8_utils.reduce_fp8_amaxes([layer])
    with fp8_utils.get_fp8_context(config, layer_no=0):
        layer(x)  # forward only: no gradient amax pending at the step's end
    fp8_utils.reduce_fp8_amaxes([layer])
    history = layer.state_dict()["fp8_amax_history"]
    # input amax 0.5 and weight amax 1 three times; the gradient amax (1.0) of the two steps with a backward.
    assert history.tolist() == [[0.5, 0.5, 0.5, 0.0], [1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
    assert layer.state_dict()["fp8_amax_recorded_count"].tolist() == [3, 3, 2]
    restored = _transformer_layer_column(config, init_method=torch.nn.init.ones_, bias=False)
    restored.load_state_dict(layer.state_dict())
    assert restored.fp8_scaling(fp8_utils.Fp8RecipeSettings.from_config(config)).input.num_recorded == 3


def test_layers_outside_transformer_layers_have_no_histories_and_ignore_old_ones():
    """The output layer never runs in an FP8 region: no amax-history buffers; a state dict that has them (older
    checkpoints) loads strictly, ignoring them."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    config = _fp8_layer_config()
    output_layer = ColumnParallelLinear(8, 8, config=config, init_method=torch.nn.init.ones_, bias=False)
    assert sorted(output_layer.state_dict()) == ["weight"]
    old = {"weight": torch.full((8, 8), 2.0), "fp8_amax_history": torch.ones(3, 4),
           "fp8_amax_recorded_count": torch.ones(3, dtype=torch.int64)}
    result = output_layer.load_state_dict(old, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(output_layer.weight, torch.full((8, 8), 2.0))
    assert sorted(output_layer.state_dict()) == ["weight"]


def test_state_dict_without_fp8_histories_loads_strictly_and_starts_them_empty():
    """A non-FP8 layer's state dict loads strictly into a delayed-scaling layer (fine-tuning in FP8): weights
    load, the histories start empty and the load is counted; a state dict with only one of the two history
    buffers still fails on the other."""
    from megatron.core.fp8.checkpoint import count_fp8_histories_started_empty
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    plain_config = _fp8_layer_config(fp8=None)
    fp8_config = _fp8_layer_config(fp8="hybrid")
    plain = ColumnParallelLinear(8, 8, config=plain_config, init_method=lambda w: torch.nn.init.normal_(w),
                                 bias=True)
    plain_state = plain.state_dict()
    assert sorted(plain_state) == ["bias", "weight"]
    layer = _transformer_layer_column(fp8_config, init_method=torch.nn.init.zeros_, bias=True)
    x = torch.full((2, 8), 0.5)
    with fp8_utils.get_fp8_context(fp8_config, layer_no=0):
        layer(x)  # records amaxes: loading must reset them
    fp8_utils.reduce_fp8_amaxes([layer])
    assert layer.fp8_amax_recorded_count.tolist() == [1, 1, 0]

    result = layer.load_state_dict(plain_state, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(layer.weight, plain.weight) and torch.equal(layer.bias, plain.bias)
    assert torch.equal(layer.fp8_amax_history, torch.zeros(3, 4))
    assert layer.fp8_amax_recorded_count.tolist() == [0, 0, 0]
    assert count_fp8_histories_started_empty([layer]) == 1
    assert count_fp8_histories_started_empty([layer]) == 0  # counted once per load
    # The load also forgot that a history had been recorded: the next scale comes from the tensor's own amax.
    with fp8_utils.get_fp8_context(fp8_config, layer_no=0):
        layer(torch.full((2, 8), 0.25))
    assert float(layer.fp8_scaling(fp8_utils.Fp8RecipeSettings.from_config(fp8_config)).input.scale_for(
        torch.full((2, 8), 0.25))) == 448.0 / 0.25

    partial = {**plain_state, "fp8_amax_history": torch.ones(3, 4)}
    with pytest.raises(RuntimeError, match="fp8_amax_recorded_count"):
        layer.load_state_dict(partial, strict=True)


# ---- GEMM paths --------------------------------------------------------------------------------------------------


def _accumulation_bound(a, b, out_rounding, unit=2.0**-23):
    """Elementwise bound on |GEMM - exact GEMM| for `a @ b` (fp64 operands): each of the K products is exact
    in fp32 (float8 x float8), and fp32 summation in any order is off by at most about K * 2**-24 of the sum of
    their magnitudes; we take K * 2**-23 for the scales applied to the sum (`unit`: an accumulator with fewer
    bits); plus the output's own rounding."""
    k = a.shape[1]
    return k * unit * (a.abs() @ b.abs()) + out_rounding


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, in_features, out_features", [
    (64, 32, 48),  # every GEMM dimension a multiple of 16: forward, dgrad and wgrad run torch._scaled_mm
    (64, 32, 40),  # 40 -> 48 adds 20% work: padded to multiples of 16, still torch._scaled_mm
    (50, 24, 40),  # padding would double the work: the three GEMMs run emulated on the GPU
])
def test_fp8_linear_on_cuda_matches_the_emulation_reference(monkeypatch, tokens, in_features, out_features):
    if not fp8_utils.scaled_mm_supported("cuda"):
        pytest.skip("this GPU has no FP8 torch._scaled_mm kernel (FP8 tensor cores need compute capability 8.9+)")
    recipe = fp8_utils.Fp8RecipeSettings(fp8_utils.get_fp8_format("hybrid"), "tensorwise")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.3
    bias = torch.randn(out_features, generator=generator)
    grad = torch.randn(tokens, out_features, generator=generator)
    shapes = ((tokens, in_features, out_features), (tokens, out_features, in_features),
              (out_features, tokens, in_features))
    scaled_mm_calls = sum(fp8_utils.gemm_plan("cuda", *shape) != "emulate" for shape in shapes)
    assert scaled_mm_calls == (0 if tokens == 50 else 3)

    def run(device, emulate=False):
        # `.to("cpu")` of a CPU tensor is the tensor itself: clone, so no run touches the shared inputs.
        inputs = [t.detach().clone().to(device).requires_grad_(True) for t in (x, weight, bias)]
        scaling = fp8_utils.LinearScaling(recipe, "none")
        with fp8_utils.force_fp8_gemm_emulation(emulate):
            out = fp8_utils.fp8_linear(*inputs, scaling)
            out.backward(grad.to(device))
        return [t.detach().cpu() for t in (out, *(i.grad for i in inputs))]

    calls = []
    scaled_mm = torch._scaled_mm

    def counting_scaled_mm(*args, **kwargs):
        calls.append(args[0].device.type)
        return scaled_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting_scaled_mm)
    reference = run("cpu", emulate=True)  # dequantize-and-matmul in fp32 on the CPU
    assert calls == []
    on_cuda = run("cuda")
    assert calls == ["cuda"] * scaled_mm_calls
    emulated_on_cuda = run("cuda", emulate=True)
    assert len(calls) == scaled_mm_calls

    # Both sides quantize identically (max, an fp32 division and multiply, round-to-nearest-even casts are exact
    # operations on every device); they differ in how the sums of K exact FP8 products are accumulated. In fp32
    # (the CPU, and emulation on the GPU) each GEMM's tolerance is its fp32 accumulation bound, K * 2**-23 times
    # the sum of the products' magnitudes, plus one rounding of the fp32 output (2**-24 relative). FP8 tensor
    # cores (Hopper) keep fewer bits in their accumulator, about 14 (DeepSeek-V3 report; on an H100 the output of
    # the 64x32x48 case was 4.2e-4 beyond twice the fp32 bound): a `_scaled_mm` result is held to K * 2**-13 of
    # the products' magnitudes, well below a wrong scale or layout (errors of the size of the outputs).
    from tests.unit_tests.fp8.fp8_reference import fake_quantize_reference

    f, b = recipe.fp8_format.forward_dtype, recipe.fp8_format.backward_dtype
    xq, wq, gq = fake_quantize_reference(x, f), fake_quantize_reference(weight, f), fake_quantize_reference(grad, b)
    expected = [xq @ wq.T + bias.double(), gq @ wq, gq.T @ xq, grad.double().sum(0)]
    bounds = [
        _accumulation_bound(xq, wq.T, 2.0**-24 * expected[0].abs()) + 2.0**-24 * bias.double().abs(),
        _accumulation_bound(gq, wq, 2.0**-24 * expected[1].abs()),
        _accumulation_bound(gq.T, xq, 2.0**-24 * expected[2].abs()),
        tokens * 2.0**-23 * grad.double().abs().sum(0),  # fp32 sum of the high-precision gradient
    ]
    names = ("output", "input grad", "weight grad", "bias grad")
    tensor_core_bounds = [
        _accumulation_bound(xq, wq.T, 2.0**-24 * expected[0].abs(), unit=2.0**-13) + 2.0**-24 * bias.double().abs(),
        _accumulation_bound(gq, wq, 2.0**-24 * expected[1].abs(), unit=2.0**-13),
        _accumulation_bound(gq.T, xq, 2.0**-24 * expected[2].abs(), unit=2.0**-13),
        bounds[3],
    ]
    on_tensor_cores = scaled_mm_calls > 0
    for name, actual, emulated, want, bound, tc_bound in zip(names, on_cuda, emulated_on_cuda, reference, bounds,
                                                             tensor_core_bounds):
        for label, value, own_bound in (("CUDA", actual, tc_bound if on_tensor_cores else bound),
                                        ("CUDA emulation", emulated, bound)):
            excess = (value.double() - want.double()).abs() - (bound + own_bound)  # each side's own bound
            assert excess.max() <= 0, f"{name}, {label} vs CPU emulation: exceeds the bound by {excess.max():.3g}"


def test_cpu_gemm_policy_emulates_by_default_and_runs_scaled_mm_when_forced(monkeypatch):
    """On the CPU the FP8 GEMMs are emulated unless `force_fp8_scaled_mm()` asks for torch's kernel; both give
    the same numbers (float8 operands are exact in fp32; sums of 32 products differ in order only)."""
    recipe = fp8_utils.Fp8RecipeSettings(fp8_utils.get_fp8_format("hybrid"), "tensorwise")
    generator = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(*shape, generator=generator) for shape in ((8, 32), (16, 32), (16,)))
    grad = torch.randn(8, 16, generator=generator)
    assert fp8_utils.scaled_mm_supported("cpu")  # torch's CPU build has the kernel (probed once, before counting)
    calls = []
    scaled_mm = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or scaled_mm(*a, **k))

    def run():
        inputs = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
        out = fp8_utils.fp8_linear(*inputs, fp8_utils.LinearScaling(recipe, "none"))
        out.backward(grad)
        return [out.detach(), *(t.grad for t in inputs)]

    default = run()
    assert calls == []
    with fp8_utils.force_fp8_scaled_mm():
        forced = run()
    assert len(calls) == 3  # forward, dgrad and wgrad
    with fp8_utils.force_fp8_scaled_mm(), fp8_utils.force_fp8_gemm_emulation():
        run()
    assert len(calls) == 3  # the innermost choice wins
    for a, b in zip(default, forced):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_gemm_plan_pads_cheap_shapes_and_reports_emulated_ones_once(monkeypatch, caplog):
    """Shapes that are not multiples of 16: padded when that adds at most 25% work, else emulated, said once per
    layer and shape. The GPU rule is applied to the CPU kernel here (it takes any shape itself)."""
    assert fp8_utils.gemm_plan("cpu", 50, 24, 40) == "emulate"  # the CPU default
    monkeypatch.setattr(fp8_linear_module, "_needs_multiples_of_16", lambda device_type: True)
    with fp8_utils.force_fp8_scaled_mm():
        assert fp8_utils.gemm_plan("cpu", 64, 32, 48) == "scaled_mm"
        assert fp8_utils.gemm_plan("cpu", 64, 32, 40) == "pad"  # 64*32*48 / (64*32*40) = 1.2
        assert fp8_utils.gemm_plan("cpu", 8192, 2048, 5461) == "pad"
        assert fp8_utils.gemm_plan("cpu", 50, 24, 40) == "emulate"  # 64*32*48 / (50*24*40) = 2.05
        assert fp8_utils.gemm_plan("cpu", 8, 8, 8) == "emulate"
    assert fp8_utils.gemm_plan("cpu", 64, 32, 40) == "emulate"  # not forced: the CPU emulates

    recipe = fp8_utils.Fp8RecipeSettings(fp8_utils.get_fp8_format("hybrid"), "tensorwise")
    generator = torch.Generator().manual_seed(1)
    calls = []
    scaled_mm = torch._scaled_mm

    def recording_scaled_mm(a, b, **kwargs):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return scaled_mm(a, b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording_scaled_mm)
    for tokens, in_features, out_features in ((64, 32, 40), (50, 24, 40)):
        x = torch.randn(tokens, in_features, generator=generator)
        weight = torch.randn(out_features, in_features, generator=generator)
        grad = torch.randn(tokens, out_features, generator=generator)
        results = []
        for forced in (True, False):
            inputs = [t.clone().requires_grad_(True) for t in (x, weight)]
            with fp8_utils.force_fp8_scaled_mm() if forced else fp8_utils.force_fp8_gemm_emulation():
                with caplog.at_level(logging.WARNING, logger="megatron.core.fp8.linear"):
                    for _ in range(2):
                        out = fp8_utils.fp8_linear(*inputs, None, fp8_utils.LinearScaling(recipe, "none"),
                                                   label="layer-under-test")
                        out.backward(grad)
            results.append([out.detach(), *(t.grad for t in inputs)])
        for padded, emulated in zip(*results):
            torch.testing.assert_close(padded, emulated, rtol=EXACT_RTOL, atol=EXACT_ATOL)
    # (64, 32, 40): twice forward, dgrad and wgrad, each padded to multiples of 16; (50, 24, 40): never.
    assert calls == [((64, 32), (32, 48)), ((64, 48), (48, 32)), ((48, 64), (64, 32))] * 2
    emulated_lines = [r.getMessage() for r in caplog.records if "runs emulated" in r.getMessage()]
    # One line per GEMM shape of the emulated layer (forward, dgrad, wgrad), not one per call.
    assert len(emulated_lines) == 3 and all("layer-under-test" in line for line in emulated_lines), emulated_lines
    assert "[50 x 24] x [24 x 40]" in emulated_lines[0]

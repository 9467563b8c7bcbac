"""PTQ through modelopt's Megatron plugin at TP1, TP2 and TP2 with sequence parallelism (2 ranks): every
column- and row-parallel linear is quantized by the plugin's parallel-layer classes, every amax is the same on
both tensor-parallel ranks (a column-parallel per-channel weight amax: the ranks' rows together) and equals the
TP1 model's, and the TP2 outputs equal TP1's within the bound below. FP8 (per-tensor) and INT8 (per-channel
weights) configurations, both run on CPUs; and a MoE GPT, whose experts the plugin quantizes as well."""

import pytest
import torch

from megatron.core.optional_deps import modelopt_installed
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.post_training.ptq_layouts import moe_ptq_across_layouts, ptq_across_layouts

pytestmark = pytest.mark.skipif(
    not modelopt_installed(), reason="nvidia-modelopt is not installed (pip install -e '.[modelopt]')"
)

QUANT_CFGS = ("fp8", "int8")
TP2_LAYOUTS = ("tp2", "tp2_sp")
# Amaxes are maxima of activations; TP2 sums a row-parallel GEMM's partial products in another order than TP1,
# so the inputs of later layers (and their maxima) differ in the last bits of fp32.
AMAX_RTOL = 1e-5
# TP2 quantizes the values TP1 does with the same amaxes; the quantized GEMM inputs differ only where an
# activation that TP2 summed in another order (row-parallel partial sums) lands on the other side of a rounding
# boundary of the quantization grid, which would move that element by one step (FP8 e4m3: 2**-3 relative). The
# norms' input quantizers, which would quantize the residual stream itself, are off (see
# `extensions.modelopt.NORM_QUANTIZERS_OFF`). Measured: largest logit difference 1.2e-7 (fp8 and int8) on
# logits of magnitude ~0.6, against 8e-3 (fp8) / 2e-3 (int8) between the quantized and unquantized model.
LOGITS_ATOL = 1e-5


@pytest.fixture(scope="module")
def layouts():
    return run_on_ranks(2, ptq_across_layouts, QUANT_CFGS)


@pytest.mark.parametrize("quant_cfg", QUANT_CFGS)
def test_every_parallel_linear_is_quantized_by_the_plugin(layouts, quant_cfg):
    for rank_result in layouts:
        for layout, outcome in rank_result[quant_cfg].items():
            classes = outcome["parallel_linears"]
            assert len(classes) == 2 * 4 + 1, (layout, classes)  # qkv, proj, fc1, fc2 per layer; output layer
            for name, cls in classes.items():
                expected = "_MegatronRowParallelLinear" if name.endswith(("linear_proj", "linear_fc2")) \
                    else "_MegatronColumnParallelLinear"
                assert cls == expected, (layout, name, cls)


def _is_column_per_channel_weight(name, amax):
    column = name.split(".weight_quantizer")[0].endswith(("linear_qkv", "linear_fc1", "output_layer"))
    return name.endswith("weight_quantizer") and column and amax.numel() > 1


@pytest.mark.parametrize("quant_cfg", QUANT_CFGS)
def test_amaxes_agree_across_tensor_parallel_ranks_and_with_tp1(layouts, quant_cfg):
    tp1 = layouts[0][quant_cfg]["tp1"]["amaxes"]
    per_channel_seen = False
    for layout in TP2_LAYOUTS:
        for rank_result in layouts:
            amaxes = rank_result[quant_cfg][layout]["amaxes"]
            assert set(amaxes) == set(tp1), (layout, set(amaxes) ^ set(tp1))
            for name, pieces in amaxes.items():
                (expected,) = tp1[name]
                if _is_column_per_channel_weight(name, pieces[0]):
                    per_channel_seen = True
                    actual = torch.cat(pieces)  # each rank's output rows
                else:
                    assert torch.equal(pieces[0], pieces[1]), (layout, name)  # bit-identical on both TP ranks
                    actual = pieces[0]
                torch.testing.assert_close(actual, expected, rtol=AMAX_RTOL, atol=0, msg=f"{layout} {name}")
    assert per_channel_seen == (quant_cfg == "int8")


@pytest.mark.parametrize("quant_cfg", QUANT_CFGS)
def test_tp2_outputs_equal_tp1(layouts, quant_cfg):
    expected = layouts[0][quant_cfg]["tp1"]
    unquantized = layouts[0]["unquantized"]
    # Quantization is in effect: the outputs moved away from the unquantized model's.
    assert (expected["logits"] - unquantized["logits"]).abs().max() > 100 * LOGITS_ATOL
    for layout in TP2_LAYOUTS:
        for rank_result in layouts:
            outcome = rank_result[quant_cfg][layout]
            torch.testing.assert_close(outcome["logits"], expected["logits"], atol=LOGITS_ATOL, rtol=0,
                                       msg=f"{quant_cfg} {layout}")
            assert abs(outcome["loss"] - expected["loss"]) < LOGITS_ATOL
    assert abs(expected["loss"] - unquantized["loss"]) > 1e-5


def test_moe_experts_are_quantized_and_tp2_equals_tp1():
    """The MoE experts (SequentialMLP) are quantized by the plugin's expert support too; TP2 with sequence
    parallelism equals TP1 within the same bound (measured 1.2e-7)."""
    for rank_result in run_on_ranks(2, moe_ptq_across_layouts):
        tp1, tp2 = rank_result["tp1"], rank_result["tp2_sp"]
        for layout in (tp1, tp2):
            experts = layout["experts"]
            assert len(experts) == 2 * (1 + 4 * 2), experts  # per layer: the experts module, 4 x (fc1, fc2)
            for name, cls in experts.items():
                assert cls == ("QuantSequentialMLP" if name.endswith("mlp.experts") else
                               "QuantColumnParallelLinear" if name.endswith("linear_fc1") else
                               "QuantRowParallelLinear"), (name, cls)
        assert (tp1["quantized"] - tp1["unquantized"]).abs().max() > 100 * LOGITS_ATOL
        torch.testing.assert_close(tp2["quantized"], tp1["quantized"], atol=LOGITS_ATOL, rtol=0)

"""Host work of one FP8 linear layer: the aten ops one forward + backward dispatches, against a budget built
here from what the layer has to do. On a GPU every op is host time spent enqueueing (at the shapes of a layer's
GEMMs the host, not the GPU, bounds an FP8 linear), so an op added to the path fails this test.

The layer is the one the model uses (a column-parallel linear of a transformer layer, with bias, bf16, in an
FP8 region, its FP8 weight cached for the step) with `torch._scaled_mm` forced on the CPU, so that it takes the
branches it takes on a GPU. `examples/fp8/host_overhead.py` prints the same counts and the host time.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core import fp8_utils


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] = self.ops.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


# Quantizing one tensor (2-D, its transposed bytes too, as the backward GEMM reads it column-major).
CURRENT_SCALE = {  # tensorwise: the scale from the tensor's own amax
    "amax (one reduction)": 1,
    "scale = max * (1 / amax), 1 where out of range (reciprocal, mul_, clamp, ne, masked_fill_)": 5,
    "reciprocal of the scale (for the GEMM)": 1,
}
CAST = {"scale as a one-element tensor, multiply, clamp, convert": 4}
TRANSPOSED_BYTES = {"t, clone": 2}
STEP_SCALE = {  # delayed: the scale from the history, computed once per step and role
    "the history's amax": 1, **{key: value for key, value in CURRENT_SCALE.items() if "amax (" not in key},
    "scale as a one-element tensor": 1,
}
DELAYED_QUANTIZE = {"amax (one reduction)": 1, "multiply, clamp, convert (the step's scale)": 3}
PENDING_MAX = {"MAX into the pending amax": 1}
WEIGHT = {"detach (the weight is quantized outside the autograd function)": 1}
# Everything else one forward + backward of the layer does.
LAYER = {
    "tensor-parallel copy region (view forward, clone backward)": 2,
    "input and output gradient to 2-D, output and input gradient back to 3-D (views)": 4,
    "forward GEMM: w.t() view, _scaled_mm (bias folded in)": 2,
    "input-gradient GEMM: column-major copy of the weight (t, clone, t), _scaled_mm": 4,
    "weight-gradient GEMM: the input's transposed bytes as a column-major view, _scaled_mm": 2,
    "bias gradient (sum)": 1,
    "gradients accumulated into x.grad, weight.grad, bias.grad (add_)": 3,
}


def _budget(*parts):
    return sum(sum(part.values()) for part in parts)


BUDGETS = {
    # (a microbatch after the first of a step, the step's first microbatch)
    "tensorwise": (
        _budget(LAYER, CURRENT_SCALE, CAST, TRANSPOSED_BYTES, CURRENT_SCALE, CAST, TRANSPOSED_BYTES),  # input, grad
        # the first also quantizes the weight (no transposed bytes without --keep-fp8-transpose-cache)
        _budget(LAYER, CURRENT_SCALE, CAST, TRANSPOSED_BYTES, CURRENT_SCALE, CAST, TRANSPOSED_BYTES,
                WEIGHT, CURRENT_SCALE, CAST),
    ),
    "delayed": (
        _budget(LAYER, DELAYED_QUANTIZE, PENDING_MAX, TRANSPOSED_BYTES, DELAYED_QUANTIZE, PENDING_MAX,
                TRANSPOSED_BYTES),
        # the first computes the step's scales (input, output gradient, weight) and has nothing pending yet
        _budget(LAYER, DELAYED_QUANTIZE, STEP_SCALE, TRANSPOSED_BYTES, DELAYED_QUANTIZE, STEP_SCALE,
                TRANSPOSED_BYTES, WEIGHT, DELAYED_QUANTIZE, STEP_SCALE),
    ),
}


def _ops_per_microbatch(recipe):
    from megatron.core.extensions.transformer_engine import layer_classes
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, fp8="hybrid", fp8_recipe=recipe,
                               params_dtype=torch.bfloat16, bf16=True)
    torch.manual_seed(0)
    layer = layer_classes(config)[0](16, 32, config=config, init_method=torch.nn.init.normal_, bias=True)
    x = torch.randn(8, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(8, 2, 32, dtype=torch.bfloat16)

    def microbatch():
        with fp8_utils.get_fp8_context(config, layer_no=0):
            out, _ = layer(x)
        out.backward(grad)

    counts = []
    with fp8_utils.force_fp8_scaled_mm():
        microbatch()
        fp8_utils.reduce_fp8_amaxes([layer])  # the step hook: a history recorded, the weight cached from now on
        microbatch()
        microbatch()
        fp8_utils.reduce_fp8_amaxes([layer])
        for _ in range(2):  # the step's first microbatch, then a later one
            with _OpCounter() as counter:
                microbatch()
            counts.append(counter.ops)
    return counts[1], counts[0]


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_layer_dispatches_no_more_ops_than_it_needs(recipe):
    assert fp8_utils.scaled_mm_supported("cpu")
    later, first = _ops_per_microbatch(recipe)
    later_budget, first_budget = BUDGETS[recipe]
    assert sum(later.values()) <= later_budget, (later_budget, later)
    assert sum(first.values()) <= first_budget, (first_budget, first)
    assert later["aten._scaled_mm.default"] == 3  # the layer really ran its three GEMMs in FP8

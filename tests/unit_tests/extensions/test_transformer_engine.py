"""The Transformer Engine backend: chosen by `--transformer-impl`, required only when asked for, and (on a GPU
with transformer-engine) numerically equivalent to the local layers."""

import pytest
import torch

from megatron.core.extensions import transformer_engine as te_backend
from megatron.core.optional_deps import HAVE_TE
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig


def _config(**overrides):
    return TransformerConfig(**{"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, **overrides})


def test_local_layers_by_default_and_transformer_engine_only_when_asked():
    assert te_backend.layer_classes(_config()) == (ColumnParallelLinear, RowParallelLinear)
    if HAVE_TE:
        pytest.skip("transformer-engine is importable here; the missing-library message is not reachable")
    with pytest.raises(RuntimeError, match="--transformer-impl transformer_engine needs transformer-engine"):
        te_backend.layer_classes(_config(transformer_impl="transformer_engine"))
    with pytest.raises(RuntimeError, match="--transformer-impl transformer_engine needs transformer-engine"):
        te_backend.te_recipe(_config(fp8="hybrid", transformer_impl="transformer_engine"))


@pytest.fixture
def single_gpu_model_parallel(tmp_path):
    import torch.distributed as dist

    from megatron.core import parallel_state

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TE, reason="needs transformer-engine")
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_te_linear_matches_local_layers_in_fp32_and_fp8(single_gpu_model_parallel, recipe):
    from megatron.core.fp8_utils import get_fp8_context

    torch.manual_seed(0)
    config = _config(transformer_impl="transformer_engine", fp8="hybrid", fp8_recipe=recipe)
    te_column, te_row, _ = te_backend.te_linear_classes()
    init = torch.nn.init.normal_
    local_config = _config(fp8="hybrid", fp8_recipe=recipe)
    layers = {
        "te": (te_column(64, 128, config=config, init_method=init), te_row(128, 64, config=config, init_method=init)),
        "local": (ColumnParallelLinear(64, 128, config=local_config, init_method=init),
                  RowParallelLinear(128, 64, config=local_config, init_method=init, input_is_parallel=True)),
    }
    with torch.no_grad():
        for te_layer, local_layer in zip(layers["te"], layers["local"]):
            te_layer.weight.copy_(local_layer.weight)
            te_layer.bias.copy_(local_layer.bias)
    x = torch.randn(32, 4, 64, device="cuda")

    def run(name, fp8_config):
        column, row = layers[name]
        with get_fp8_context(fp8_config, layer_no=0):
            hidden, _ = column(x)
            out, _ = row(hidden)
        return out

    te_fp32 = layers["te"][1](layers["te"][0](x)[0])[0]
    local_fp32 = layers["local"][1](layers["local"][0](x)[0])[0]
    torch.testing.assert_close(te_fp32, local_fp32, rtol=1e-4, atol=1e-4)
    te_fp8, local_fp8 = run("te", config), run("local", local_config)
    # Both quantize every GEMM operand to FP8: each is within ~5% of fp32 (see test_fp8_linear), and of each other.
    for out in (te_fp8, local_fp8):
        assert ((out - local_fp32).norm() / local_fp32.norm()).item() < 0.12
    assert ((te_fp8 - local_fp8).norm() / local_fp8.norm()).item() < 0.12

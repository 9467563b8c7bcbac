"""The Transformer Engine backend: chosen by `--transformer-impl`, required only when asked for, and (on a GPU
with transformer-engine) numerically equivalent to the local layers.

TE installs only with CUDA. On CPU, the `fake_te_bases` tests run this repository's wrappers around TE's
`Linear` and `LayerNormLinear` on fake base classes (TE 2.x's constructor arguments and parameter registration,
plain torch arithmetic): they check the wrappers and the layer wiring (what reaches TE's constructors, the fused
norm-linear for QKV and fc1 reading the layer's norm parameters, the layer not applying those norms itself, the
local parameter and checkpoint names) against torch computed in the test and the local layer, and nothing about
TE itself. The `gpu` tests run TE and skip, with the reason, where CUDA or TE is missing.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.extensions import transformer_engine as te_backend
from megatron.core.optional_deps import HAVE_TE
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

NEEDS_TE = "needs transformer-engine, which installs only with CUDA; the fake_te_bases tests cover the wrappers"


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
@pytest.mark.skipif(not HAVE_TE, reason=NEEDS_TE)
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


# ---- CPU: this repository's TE wrappers on fake TE base classes ---------------------------------------------
#
# TE cannot be installed without CUDA, so these tests do not run TE and say nothing about TE's arithmetic. They
# run the wrapper classes `make_te_linear_classes` builds (constructor mapping, return convention, borrowed norm
# parameters, omitted extra state) and the layer wiring on top of two fake bases that record what the wrappers
# pass to TE's constructors and compute plain `F.linear` / `F.layer_norm` / `F.rms_norm` with the parameters TE
# would read. Expected values come from torch directly (and from the local layer, which does not use the
# wrappers). The tests that run TE itself are the `gpu`-marked ones in this file.

fake_te_bases = pytest.mark.fake_te_bases


class _FakeTELinearBase(torch.nn.Module):
    """Records the keyword arguments of TE `Linear`'s constructor and registers parameters as TE 2.x does (TP size
    1); computes `F.linear`. Its extra state is a non-empty byte tensor, as TE's is under FP8."""

    def __init__(self, in_features, out_features, *, sequence_parallel, fuse_wgrad_accumulation, tp_group, tp_size,
                 get_rng_state_tracker, init_method, bias, return_bias, params_dtype, device, parallel_mode):
        super().__init__()
        self.constructor_kwargs = dict(
            in_features=in_features, out_features=out_features, sequence_parallel=sequence_parallel,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation, tp_group=tp_group, tp_size=tp_size,
            get_rng_state_tracker=get_rng_state_tracker, bias=bias, return_bias=return_bias,
            params_dtype=params_dtype, device=device, parallel_mode=parallel_mode)
        self.return_bias = return_bias
        self.loaded_extra_states = []
        self.register_parameter("weight", torch.nn.Parameter(
            torch.empty(out_features, in_features, dtype=params_dtype, device=device)))
        init_method(self.weight)
        if bias:
            self.register_parameter("bias", torch.nn.Parameter(torch.zeros(out_features, dtype=params_dtype,
                                                                           device=device)))
        else:
            self.bias = None

    def get_extra_state(self):
        return torch.tensor([1, 2, 3], dtype=torch.uint8)

    def set_extra_state(self, state):
        self.loaded_extra_states.append(state)

    def _linear(self, x):
        output = F.linear(x, self.weight, None if self.return_bias else self.bias)
        return (output, self.bias) if self.return_bias else output

    def forward(self, x):
        return self._linear(x)


class _FakeTELayerNormLinearBase(_FakeTELinearBase):
    """Also records TE `LayerNormLinear`'s norm arguments, registers `layer_norm_weight` (and `layer_norm_bias`,
    or assigns None for RMSNorm) as TE does, and reads them as attributes when it runs."""

    def __init__(self, in_features, out_features, *, eps, normalization, zero_centered_gamma, **kwargs):
        super().__init__(in_features, out_features, **kwargs)
        self.constructor_kwargs.update(eps=eps, normalization=normalization, zero_centered_gamma=zero_centered_gamma)
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        gamma = torch.full((in_features,), 0.0 if zero_centered_gamma else 1.0, dtype=kwargs["params_dtype"])
        self.register_parameter("layer_norm_weight", torch.nn.Parameter(gamma))
        if normalization != "RMSNorm":
            self.register_parameter("layer_norm_bias", torch.nn.Parameter(torch.zeros(in_features)))
        else:
            self.layer_norm_bias = None

    def forward(self, x):
        gamma = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
        if self.normalization == "RMSNorm":
            normed = F.rms_norm(x, (x.shape[-1],), gamma, self.eps)
        else:
            normed = F.layer_norm(x, (x.shape[-1],), gamma, self.layer_norm_bias, self.eps)
        return self._linear(normed)


@pytest.fixture
def wrappers_on_fake_te_bases(monkeypatch):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    classes = te_backend.make_te_linear_classes(_FakeTELinearBase, _FakeTELayerNormLinearBase)
    monkeypatch.setattr(te_backend, "te_linear_classes", lambda: classes)
    model_parallel_cuda_manual_seed(3)  # attention forks the model-parallel stream
    yield classes
    get_cuda_rng_tracker().reset()


@fake_te_bases
def test_wrappers_pass_the_config_to_te_constructors_and_return_output_and_bias(wrappers_on_fake_te_bases):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer.norms import build_norm

    column, row, norm_column = wrappers_on_fake_te_bases
    config = _config(hidden_size=16, normalization="RMSNorm", layernorm_epsilon=1e-3,
                     layernorm_zero_centered_gamma=True, transformer_impl="transformer_engine")
    weight = torch.arange(24 * 16, dtype=torch.float32).reshape(24, 16) / 100

    def init(tensor):
        with torch.no_grad():
            tensor.copy_(weight[: tensor.shape[0], : tensor.shape[1]])

    common = dict(sequence_parallel=False, fuse_wgrad_accumulation=config.gradient_accumulation_fusion,
                  tp_group=None, tp_size=1, get_rng_state_tracker=get_cuda_rng_tracker, params_dtype=torch.float32,
                  device=torch.device("cpu"))
    layers = {
        "column": column(16, 24, config=config, init_method=init),
        "row": row(16, 24, config=config, init_method=init, bias=False, skip_bias_add=True),
        "norm column": norm_column(16, 24, config=config, init_method=init, norm=build_norm(config, 16),
                                   skip_bias_add=True),
    }
    assert layers["column"].constructor_kwargs == dict(common, in_features=16, out_features=24, bias=True,
                                                       return_bias=False, parallel_mode="column")
    assert layers["row"].constructor_kwargs == dict(common, in_features=16, out_features=24, bias=False,
                                                    return_bias=True, parallel_mode="row")
    assert layers["norm column"].constructor_kwargs == dict(
        common, in_features=16, out_features=24, bias=True, return_bias=True, parallel_mode="column", eps=1e-3,
        normalization="RMSNorm", zero_centered_gamma=True)

    # Megatron's (output, bias) convention: bias None when added inside, the bias itself when the caller adds it.
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        layers["column"].bias.copy_(torch.linspace(-1, 1, 24))
    output, bias = layers["column"](x)
    assert bias is None
    torch.testing.assert_close(output, x @ weight.T + torch.linspace(-1, 1, 24), rtol=1e-6, atol=1e-6)
    output, bias = layers["row"](x)
    assert bias is None  # no bias at all
    torch.testing.assert_close(output, x @ weight.T, rtol=1e-6, atol=1e-6)
    output, bias = layers["norm column"](x)
    assert bias is layers["norm column"].bias
    gamma = 1 + build_norm(config, 16).weight  # zero-centred: a fresh norm's weight is 0, applied as 1
    rms = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-3) * gamma
    torch.testing.assert_close(output, rms @ weight.T, rtol=1e-5, atol=1e-5)

    # Arguments TE has no counterpart for are refused, not dropped.
    with pytest.raises(ValueError, match="gather_output"):
        column(16, 24, config=config, init_method=init, gather_output=True)
    with pytest.raises(ValueError, match="input_is_parallel"):
        row(16, 24, config=config, init_method=init, input_is_parallel=False)
    with pytest.raises(ValueError, match="gather_output"):
        norm_column(16, 24, config=config, init_method=init, norm=build_norm(config, 16), gather_output=True)

    # TE's extra state stays out of state dicts; a state dict without it loads strictly, handing TE an empty
    # byte tensor ("nothing saved").
    for layer in layers.values():
        state = layer.state_dict()
        assert "_extra_state" not in state and "weight" in state
        layer.load_state_dict(state, strict=True)
        (loaded,) = layer.loaded_extra_states
        assert loaded.dtype == torch.uint8 and loaded.numel() == 0


def _layer_config(normalization, zero_centered, **overrides):
    return _config(num_layers=1, hidden_size=32, num_attention_heads=4, normalization=normalization,
                   layernorm_zero_centered_gamma=zero_centered, hidden_dropout=0.0, attention_dropout=0.0,
                   init_seed=3, use_cpu_initialization=True, **overrides)


def _run_layer(layer, x):
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out, _ = layer(x)  # (output, context) as upstream
    out.square().sum().backward()
    grads = {name: param.grad.clone() for name, param in layer.named_parameters()}
    return out.detach(), x.grad, grads


def _normed(x, norm, normalization, zero_centered, eps):
    """The norm computed by hand from its parameters (independent of the modules under test)."""
    gamma = norm.weight + 1 if zero_centered else norm.weight
    if normalization == "RMSNorm":
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * gamma
    centred = x - x.mean(-1, keepdim=True)
    return centred * torch.rsqrt(centred.square().mean(-1, keepdim=True) + eps) * gamma + norm.bias


@fake_te_bases
@pytest.mark.parametrize("normalization, zero_centered", [("LayerNorm", False), ("RMSNorm", True)])
def test_layer_wiring_on_fake_te_bases_fuses_the_norms_and_keeps_the_local_names(wrappers_on_fake_te_bases,
                                                                                  normalization, zero_centered):
    te_column, te_row, te_norm_column = wrappers_on_fake_te_bases
    local = TransformerLayer(_layer_config(normalization, zero_centered), layer_number=1)
    te_layer = TransformerLayer(_layer_config(normalization, zero_centered, transformer_impl="transformer_engine"),
                                layer_number=1)

    # The local layer applies its norms and uses plain column/row-parallel linears.
    assert not local.norms_fused_into_linears
    assert [type(m) for m in (local.self_attention.linear_qkv, local.self_attention.linear_proj,
                              local.mlp.linear_fc1, local.mlp.linear_fc2)] == [
        ColumnParallelLinear, RowParallelLinear, ColumnParallelLinear, RowParallelLinear]
    # Under TE, QKV and fc1 are the fused norm-linear using the layer's own norm modules' parameters.
    assert te_layer.norms_fused_into_linears
    assert [type(m) for m in (te_layer.self_attention.linear_qkv, te_layer.self_attention.linear_proj,
                              te_layer.mlp.linear_fc1, te_layer.mlp.linear_fc2)] == [
        te_norm_column, te_row, te_norm_column, te_row]
    for fused, norm in ((te_layer.self_attention.linear_qkv, te_layer.input_layernorm),
                        (te_layer.mlp.linear_fc1, te_layer.pre_mlp_layernorm)):
        assert fused.layer_norm_weight is norm.weight
        assert fused.layer_norm_bias is getattr(norm, "bias", None)
        assert not {"layer_norm_weight", "layer_norm_bias"} & set(fused._parameters)

    # Identical parameter and state-dict names (no TE `_extra_state`), so checkpoints load both ways, strictly.
    assert [name for name, _ in te_layer.named_parameters()] == [name for name, _ in local.named_parameters()]
    assert sorted(te_layer.state_dict()) == sorted(local.state_dict())
    with torch.no_grad():  # norms away from their initial values, so applying them (once) matters
        for norm in (local.input_layernorm, local.pre_mlp_layernorm):
            norm.weight.copy_(torch.linspace(-0.5, 0.7, norm.weight.numel()))
            if getattr(norm, "bias", None) is not None:
                norm.bias.copy_(torch.linspace(0.3, -0.2, norm.bias.numel()))
    te_layer.load_state_dict(local.state_dict(), strict=True)
    x = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(0))

    # The fused QKV against torch by hand: the loaded norm parameters applied once, then the QKV weight.
    qkv = te_layer.self_attention.linear_qkv
    eps = te_layer.config.layernorm_epsilon
    expected_qkv = F.linear(_normed(x, te_layer.input_layernorm, normalization, zero_centered, eps), qkv.weight,
                            qkv.bias)
    with torch.no_grad():
        torch.testing.assert_close(qkv(x)[0], expected_qkv, rtol=1e-5, atol=1e-5)

    # The whole layer against the local layer (which applies the norms itself, without the wrappers).
    local_out, local_dx, local_grads = _run_layer(local, x)
    te_out, te_dx, te_grads = _run_layer(te_layer, x)
    torch.testing.assert_close(te_out, local_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(te_dx, local_dx, rtol=1e-6, atol=1e-6)
    assert sorted(te_grads) == sorted(local_grads)
    for name, grad in local_grads.items():
        torch.testing.assert_close(te_grads[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")

    # And back: a TE layer's state dict loads strictly into a fresh local layer, which then computes the same.
    fresh = TransformerLayer(_layer_config(normalization, zero_centered), layer_number=1)
    fresh.load_state_dict(te_layer.state_dict(), strict=True)
    torch.testing.assert_close(_run_layer(fresh, x)[0], te_out, rtol=1e-6, atol=1e-6)
    # A norm parameter replaced by a wrapper is followed (the fused linear reads the norm's live attribute).
    te_layer.input_layernorm.weight = torch.nn.Parameter(torch.zeros(32))
    assert te_layer.self_attention.linear_qkv.layer_norm_weight is te_layer.input_layernorm.weight


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TE, reason=NEEDS_TE)
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_te_transformer_layer_matches_the_local_layer_in_fp32(single_gpu_model_parallel, normalization):
    """A GPT layer built with TE's layers (fused LayerNorm-linear for QKV and fc1) against the local layer, with
    the local layer's state dict loaded into it: forward and backward agree in fp32."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(3)
    config = dict(normalization=normalization, hidden_dropout=0.0, attention_dropout=0.0, init_seed=3,
                  num_layers=1, hidden_size=64, num_attention_heads=4)
    local = TransformerLayer(_config(**config), layer_number=1).cuda()
    te_layer = TransformerLayer(_config(transformer_impl="transformer_engine", **config), layer_number=1).cuda()
    _, _, te_norm_column = te_backend.te_linear_classes()
    assert isinstance(te_layer.self_attention.linear_qkv, te_norm_column)
    assert isinstance(te_layer.mlp.linear_fc1, te_norm_column)
    with torch.no_grad():
        local.input_layernorm.weight.copy_(torch.linspace(0.5, 1.5, 64))
        local.pre_mlp_layernorm.weight.copy_(torch.linspace(1.5, 0.5, 64))
    te_layer.load_state_dict(local.state_dict(), strict=True)
    x = torch.randn(32, 4, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    local_out, local_dx, local_grads = _run_layer(local, x)
    te_out, te_dx, te_grads = _run_layer(te_layer, x)
    torch.testing.assert_close(te_out, local_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(te_dx, local_dx, rtol=1e-4, atol=1e-4)
    for name, grad in local_grads.items():
        torch.testing.assert_close(te_grads[name], grad, rtol=1e-3, atol=1e-3, msg=lambda m: f"{name}: {m}")


def _train_te_block(fp8_param_gather, steps=3):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.fp8.params import fp8_weight_params
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_block import TransformerBlock

    model_parallel_cuda_manual_seed(11)
    config = _config(num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                     init_seed=5, transformer_impl="transformer_engine", fp8="hybrid", fp8_recipe="tensorwise",
                     fp8_param=fp8_param_gather)
    block = TransformerBlock(config).cuda()
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, fp8_param_gather=fp8_param_gather)
    ddp = DistributedDataParallel(config, ddp_config, block)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.05, use_distributed_optimizer=True), [ddp])
    losses = []
    for step in range(steps):
        hidden = torch.randn(32, 2, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp(hidden).square().mean()
        loss.backward()
        ddp.finish_grad_sync()
        optimizer.step()
        losses.append(loss.item())
    return losses, fp8_weight_params(block, config), ddp


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TE, reason=NEEDS_TE)
def test_fp8_param_gather_with_te_layers_trains_like_fp8_without_it(single_gpu_model_parallel):
    """`--fp8-param-gather` with TE layers (distributed optimizer, one GPU): the TE layers' weights are kept as FP8
    bytes, handed to TE dequantized (no `fp8_weight`), and TE's tensorwise autocast re-quantizes them to the same
    bytes (its scale is 448 / amax of the same whole weight), so training matches TE FP8 without it."""
    plain, _, _ = _train_te_block(False)
    gathered, weights, ddp = _train_te_block(True)
    assert len(weights) == 2 * 4  # QKV (fused norm-linear), proj, fc1 (fused norm-linear), fc2 of both layers
    assert gathered == pytest.approx(plain, abs=1e-4)
    assert plain[-1] < plain[0]
    storages = [buffer.fp8_storage for buffer in ddp.buffers if getattr(buffer, "fp8_storage", None) is not None]
    assert len(storages) == 1 and not storages[0].attach_fp8_weight
    for weight in weights:
        assert not hasattr(weight, "fp8_weight")
        scale = storages[0].scales[weight]
        requantized = (weight.detach().float() * scale).to(torch.float8_e4m3fn).float() * scale.reciprocal()
        assert torch.equal(requantized, weight.detach().float())  # the weight holds FP8-grid values

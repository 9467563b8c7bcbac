"""`--quick-geglu` (gpt-oss's gated MLP): quick_gelu(gate) * (up + offset), quick_gelu(x) = x * sigmoid(1.702 x),
with the gate clamped to at most V and up to [-V, V] under `--activation-func-clamp-value V`. The dense MLP, the
shared experts and the routed experts (sequential and grouped GEMM) against that formula written here, and the
tensor-parallel layers (TP=2) against the single-rank ones."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.activations import quick_gelu
from megatron.core.distributed.finalize_model_grads import _allreduce_sequence_parallel_grads
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP, build_experts
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.arguments import parse_args, validate_args
from megatron.training.model_config import core_transformer_config_from_args
from tests.unit_tests.multiprocess_harness import run_on_ranks

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--train-iters 4 --lr 1e-3 --mock-data --vocab-size 128")
HIDDEN, SEQ, BATCH, SEED = 16, 8, 2, 21
GPT_OSS = dict(activation_func_clamp_value=0.5, glu_linear_offset=1.0)


@pytest.fixture
def one_rank(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")


def validated(extra):
    return validate_args(parse_args(args=f"{BASE} {extra}".split()))


def quick_geglu_reference(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, clamp_value=None, offset=0.0):
    """The gated MLP from its formula; fc1's rows interleave gate and up per unit."""
    hidden = x @ fc1_weight.t() + (0 if fc1_bias is None else fc1_bias)
    gate, up = hidden[..., 0::2], hidden[..., 1::2]
    if clamp_value is not None:
        gate = torch.minimum(gate, torch.tensor(clamp_value))
        up = torch.maximum(torch.minimum(up, torch.tensor(clamp_value)), torch.tensor(-clamp_value))
    activated = gate * torch.sigmoid(1.702 * gate) * (up + offset)
    return activated @ fc2_weight.t() + (0 if fc2_bias is None else fc2_bias)


def _mlp_reference(mlp, x, config):
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    return quick_geglu_reference(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias,
                                 config.activation_func_clamp_value, config.glu_linear_offset)


def _widen(module, std=0.5):
    """Weights large enough that the clamp at 0.5 acts on most of fc1's outputs."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("weight"):
                param.normal_(std=std, generator=torch.Generator().manual_seed(len(name)))
            else:
                param.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(len(name)))


def test_quick_gelu_is_the_sigmoid_formula():
    x = torch.linspace(-6, 6, 121, dtype=torch.float64)
    torch.testing.assert_close(quick_gelu(x), x * torch.sigmoid(1.702 * x))
    assert (quick_gelu(x) - F.gelu(x)).abs().max() > 1e-2  # an approximation of GeLU, not GeLU
    assert (quick_gelu(x) - F.silu(x)).abs().max() > 1e-1  # nor swiglu's SiLU


@pytest.mark.parametrize("extra, clamp_value, offset", [
    ("", None, 0.0),
    ("--activation-func-clamp-value 0.5 --glu-linear-offset 1", 0.5, 1.0),
    ("--activation-func-clamp-value 7 --glu-linear-offset 1", 7.0, 1.0),
])
def test_flag_builds_the_gated_mlp_of_the_formula(one_rank, extra, clamp_value, offset):
    args = validated(f"--quick-geglu {extra}")
    assert args.ffn_hidden_size == 4 * 64  # upstream shrinks the default width for --swiglu only
    config = core_transformer_config_from_args(args)
    assert config.gated_linear_unit and config.activation_func is quick_gelu
    assert (config.activation_func_clamp_value, config.glu_linear_offset) == (clamp_value, offset)
    mlp = MLP(config)
    assert mlp.linear_fc1.weight.shape == (2 * 256, 64)
    _widen(mlp)
    x = torch.randn(3, 2, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = _mlp_reference(mlp, x, config)
        output, bias = mlp(x)
        assert bias is mlp.linear_fc2.bias
        torch.testing.assert_close(output + bias, expected, rtol=1e-5, atol=1e-5)
        fc1 = mlp.linear_fc1
        hidden = x @ fc1.weight.t() + fc1.bias
        if clamp_value == 0.5:
            assert (hidden.abs() > 0.5).float().mean() > 0.5  # the clamp acts on most values
        # Not the swiglu of the same weights.
        gate, up = hidden[..., 0::2], hidden[..., 1::2]
        if clamp_value is not None:
            gate, up = gate.clamp(max=clamp_value), up.clamp(-clamp_value, clamp_value)
        swiglu = F.linear(F.silu(gate) * (up + offset), mlp.linear_fc2.weight, mlp.linear_fc2.bias)
        assert (swiglu - expected).abs().max() > 1e-2


@pytest.mark.parametrize("extra, message", [
    ("--quick-geglu --swiglu", "--quick-geglu and --swiglu are exclusive MLP activations"),
    ("--quick-geglu --squared-relu", "--quick-geglu and --squared-relu are exclusive MLP activations"),
    ("--quick-geglu --openai-gelu", "--quick-geglu and --openai-gelu are exclusive MLP activations"),
    ("--glu-linear-offset 1", "--glu-linear-offset shapes the gated MLP (act(gate) * up): it needs --swiglu or "
                              "--quick-geglu"),
])
def test_flag_rules(one_rank, extra, message):
    with pytest.raises(ValueError) as error:
        validated(extra)
    assert message in str(error.value)


def dense_config(**overrides):
    fields = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, init_seed=5, hidden_dropout=0.0,
                  attention_dropout=0.0, gated_linear_unit=True, activation_func=quick_gelu, **GPT_OSS)
    fields.update(overrides)
    return TransformerConfig(**fields)


def moe_config(**overrides):
    return dense_config(**{**dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24), **overrides})


@pytest.mark.parametrize("grouped", [False, True])
def test_experts_equal_the_dense_mlp_of_their_weights(grouped):
    config = moe_config(moe_grouped_gemm=grouped)
    experts = build_experts(config, SEED, num_local_experts=4, first_global_index=0)
    assert type(experts) is (GroupedMLP if grouped else SequentialMLP)
    _widen(experts)
    tokens = torch.randn(10, HIDDEN, generator=torch.Generator().manual_seed(4))
    counts = [3, 0, 4, 3]
    if grouped:
        assert experts.uses_grouped_gemm(tokens)
    dense = MLP(dense_config(ffn_hidden_size=24))
    with torch.no_grad():
        output = experts(tokens, torch.tensor(counts))
        for expert, chunk, expert_output in zip(experts.local_experts, torch.split(tokens, counts),
                                                torch.split(output, counts)):
            dense.load_state_dict(expert.state_dict())
            dense_output, dense_bias = dense(chunk)
            torch.testing.assert_close(expert_output, dense_output + dense_bias, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(expert_output, _mlp_reference(expert, chunk, config), rtol=1e-5, atol=1e-5)


def test_shared_experts_compute_the_formula():
    config = moe_config(moe_shared_expert_intermediate_size=32)
    shared = SharedExpertMLP(config, layer_init_seed=SEED)
    _widen(shared)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(shared(x), _mlp_reference(shared, x, config), rtol=1e-5, atol=1e-5)


def _run(module, x, upstream):
    x = x.clone().requires_grad_()
    output, bias = module(x)  # (output, bias) as upstream: the dense MLP's fc2 bias, MoELayer's None
    output = output if bias is None else output + bias
    (output * upstream).sum().backward()
    return output.detach(), x.grad, {name: param.grad for name, param in module.named_parameters()}


def _difference(value, reference):
    """Largest absolute difference, relative to the reference's largest magnitude where that exceeds 1 (fp32
    rounding of a sum split over ranks grows with its size)."""
    return ((value - reference).abs().max() / reference.abs().max().clamp(min=1.0)).item()


def _largest_difference(build, sequence_parallel):
    """`build(tp)` at TP=1 over all tokens, then at TP=2 (with sequence parallelism: each rank half of every
    sequence): the largest difference of output, input gradient and parameter gradients (this rank's shards)."""
    generator = torch.Generator().manual_seed(0)
    x, upstream = (torch.randn(SEQ, BATCH, HIDDEN, generator=generator) for _ in range(2))
    parallel_state.initialize_model_parallel()
    reference = _run(build(1), x, upstream)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = parallel_state.get_tensor_model_parallel_rank()
    local = (lambda t: t.chunk(2)[rank]) if sequence_parallel else (lambda t: t)
    module = build(2)
    output, input_grad, grads = _run(module, local(x), local(upstream))
    _allreduce_sequence_parallel_grads([module])
    ref_output, ref_input_grad, ref_grads = reference
    worst = max(_difference(output, local(ref_output)), _difference(input_grad, local(ref_input_grad)))
    for name, param in module.named_parameters():
        ref_grad = ref_grads[name]
        if getattr(param, "tensor_model_parallel", False):
            ref_grad = ref_grad.chunk(2, dim=param.partition_dim)[rank]
        assert param.grad.shape == ref_grad.shape, name
        worst = max(worst, _difference(param.grad, ref_grad))
    parallel_state.destroy_model_parallel()
    return worst


def _tensor_parallel_differences():
    wide = dict(init_method_std=0.5)  # the clamp at 0.5 acts (the weights are drawn from the full matrices)

    def dense(tp):
        return MLP(dense_config(ffn_hidden_size=32, tensor_model_parallel_size=tp, **wide), init_seed=SEED)

    def moe(tp):
        config = moe_config(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, moe_grouped_gemm=True,
                            moe_shared_expert_intermediate_size=32, **wide)
        return MoELayer(config, init_seed=SEED)

    return {"dense": _largest_difference(dense, sequence_parallel=False),
            "moe": _largest_difference(moe, sequence_parallel=True)}


def test_tensor_parallel_equals_single_rank():
    assert dist.is_available()
    for diffs in run_on_ranks(2, _tensor_parallel_differences):
        for case, worst in diffs.items():
            assert worst < 1e-6, (case, worst)

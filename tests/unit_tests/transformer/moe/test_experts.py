"""Experts: initial weights depend only on the layer seed and the global expert index; GroupedMLP has
SequentialMLP's parameters and agrees with it (torch's grouped GEMM where it runs, the loop elsewhere); expert
parameters carry the marks the data-parallel wrappers read."""

import pytest
import torch

from megatron.core.optional_deps import HAVE_TE
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP, TEGroupedMLP, grouped_mm_supported
from megatron.core.transformer.transformer_config import TransformerConfig

LAYER_SEED = 11


def config(**overrides):
    fields = dict(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_ffn_hidden_size=24,
                  init_seed=5)
    fields.update(overrides)
    return TransformerConfig(**fields)


def test_expert_weights_depend_on_the_global_index_only():
    all_experts = SequentialMLP(4, config(), layer_init_seed=LAYER_SEED, first_global_index=0)
    second_half = SequentialMLP(2, config(expert_model_parallel_size=2), layer_init_seed=LAYER_SEED,
                                first_global_index=2)
    for local_index in range(2):
        for (name, value), (_, reference) in zip(second_half.local_experts[local_index].named_parameters(),
                                                 all_experts.local_experts[2 + local_index].named_parameters()):
            assert torch.equal(value, reference), name
            assert value.expert_global_index == 2 + local_index and value.num_local_experts == 2
            assert value.allreduce is False
    assert not torch.equal(all_experts.local_experts[0].linear_fc1.weight, all_experts.local_experts[1].linear_fc1.weight)


def test_upstream_constructor_arguments():
    """SequentialMLP(num_local_experts, config, submodules) as upstream: the config's base seed and this rank's
    experts (global indices from the expert-parallel rank, 0 on one rank); the old positional seed is refused."""
    upstream_style = SequentialMLP(4, config(), None)
    seeded = SequentialMLP(4, config(), layer_init_seed=5, first_global_index=0)  # 5: config()'s init_seed
    for (name, value), (_, reference) in zip(upstream_style.named_parameters(), seeded.named_parameters()):
        assert torch.equal(value, reference), name
    assert [expert.linear_fc1.weight.expert_global_index for expert in upstream_style.local_experts] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="layer_init_seed=11"):
        GroupedMLP(4, config(), LAYER_SEED)
    with pytest.raises(ValueError, match="pg_collection"):
        SequentialMLP(4, config(), None, pg_collection=object())


def _compare(cfg, counts, hidden=16):
    sequential = SequentialMLP(4, cfg, layer_init_seed=LAYER_SEED)
    grouped = GroupedMLP(4, cfg, layer_init_seed=LAYER_SEED)
    assert list(sequential.state_dict()) == list(grouped.state_dict())
    for key, value in sequential.state_dict().items():
        assert torch.equal(value, grouped.state_dict()[key]), key
    tokens = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(3))
    upstream = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(4))
    results = []
    for module in (sequential, grouped):
        inputs = tokens.clone().requires_grad_()
        (module(inputs, torch.tensor(counts)) * upstream).sum().backward()
        results.append((module(inputs, counts).detach(), inputs.grad,
                        {name: p.grad for name, p in module.named_parameters()}))
    (out_s, grad_s, params_s), (out_g, grad_g, params_g) = results
    torch.testing.assert_close(out_g, out_s, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_g, grad_s, rtol=1e-5, atol=1e-6)
    for name, grad in params_s.items():
        torch.testing.assert_close(params_g[name], grad, rtol=1e-5, atol=1e-6)
    return grouped.uses_grouped_gemm(tokens)


@pytest.mark.parametrize("gated, bias", [(False, True), (True, False)])
def test_grouped_equals_sequential(gated, bias):
    cfg = config(gated_linear_unit=gated, add_bias_linear=bias)
    used = _compare(cfg, [5, 0, 3, 4])  # an expert without tokens too
    assert used == grouped_mm_supported("cpu", torch.float32)


def test_grouped_falls_back_to_the_loop_for_unaligned_widths():
    cfg = config(hidden_size=6, num_attention_heads=2, moe_ffn_hidden_size=10)
    assert not _compare(cfg, [2, 1, 0, 3], hidden=6)


def test_te_grouped_mlp_needs_transformer_engine():
    if HAVE_TE:
        pytest.skip("transformer-engine is installed")
    with pytest.raises(ValueError, match="TEGroupedMLP needs transformer-engine"):
        TEGroupedMLP(4, config(), layer_init_seed=LAYER_SEED)


def test_token_counts_must_match():
    with pytest.raises(ValueError, match="tokens_per_expert"):
        SequentialMLP(4, config(), layer_init_seed=LAYER_SEED)(torch.zeros(3, 16), [1, 1, 0, 0])


def test_the_grouped_gemm_probe_inside_a_checkpointed_forward_leaves_the_checkpoint_alone(monkeypatch):
    """The first probe may run inside a recomputed chunk's forward: its backward must not recompute the chunk."""
    from megatron.core.transformer.moe import experts

    monkeypatch.setattr(experts, "_GROUPED_MM_SUPPORT", {})
    calls = []

    def chunk(x):
        calls.append(1)
        experts.grouped_mm_supported(x.device, x.dtype)
        return (x * x).sum()

    x = torch.full((3,), 3.0, requires_grad=True)
    torch.utils.checkpoint.checkpoint(chunk, x, use_reentrant=False).backward()
    assert len(calls) == 2  # the forward and the one recomputation in backward
    assert torch.equal(x.grad, torch.full((3,), 6.0))


def _grouped_step(module, tokens, counts, upstream):
    module.zero_grad(set_to_none=True)
    inputs = tokens.clone().requires_grad_()
    output = module(inputs, counts)
    (output * upstream).sum().backward()
    return [output.detach(), inputs.grad] + [param.grad.clone() for param in module.parameters()]


def test_grouped_mlp_step_is_bitwise_reproducible_over_intra_op_threads():
    """With biases, 1024 rows of width 64 (at least the 32768 elements from which CPU kernels split a tensor
    over the intra-op threads) and expert 1's rows straddling the threads' halves: the same step gives the same
    bits every time, with one thread or two."""
    cfg = config(hidden_size=64, num_attention_heads=4, moe_ffn_hidden_size=64, add_bias_linear=True)
    module = GroupedMLP(2, cfg, layer_init_seed=LAYER_SEED)
    counts = torch.tensor([300, 724])
    tokens = torch.randn(1024, 64, generator=torch.Generator().manual_seed(3))
    upstream = torch.randn(1024, 64, generator=torch.Generator().manual_seed(4))
    if not module.uses_grouped_gemm(tokens):
        pytest.skip("torch's grouped GEMM does not run on this build")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        reference = _grouped_step(module, tokens, counts, upstream)
        torch.set_num_threads(2)
        for _ in range(8):
            for got, expected in zip(_grouped_step(module, tokens, counts, upstream), reference):
                assert torch.equal(got, expected)
    finally:
        torch.set_num_threads(threads)

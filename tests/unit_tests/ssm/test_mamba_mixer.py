"""The Mamba mixer against the Mamba-2 formulas written out token by token from its parameters (float64), its
initial values, and tensor parallelism (TP=2, with and without sequence parallelism) and context parallelism
(CP=2, also on packed sequences) reproducing one rank."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.ssm.mamba_mixer import MambaMixer
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.multiprocess_harness import run_on_ranks

SEQ, BATCH, HIDDEN = 11, 2, 16
SHAPE = dict(mamba_head_dim=4, mamba_num_groups=2, mamba_state_dim=3, mamba_chunk_size=4)  # 8 heads, inner 32


def _config(**overrides):
    fields = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, init_seed=5, hidden_dropout=0.0,
                  hybrid_layer_pattern="M", init_method_std=0.3, **SHAPE)
    return TransformerConfig(**{**fields, **overrides})


def reference_mixer(mixer, hidden):
    """The mixer's output from its (full) parameters, one token and one head at a time, in float64."""
    groups, state_dim, head_dim = mixer.groups, mixer.state_dim, mixer.head_dim
    heads_per_group, inner_per_group = mixer.heads_per_group, mixer.inner_per_group
    params = {name: param.detach().double() for name, param in mixer.named_parameters()}
    projected = hidden.double() @ params["in_proj.weight"].T  # [s, b, groups * rows]
    per_group = projected.reshape(SEQ, BATCH, groups, -1)
    z = per_group[..., :inner_per_group]
    xbc = per_group[..., inner_per_group:2 * inner_per_group + 2 * state_dim].reshape(SEQ, BATCH, -1)
    dt_raw = per_group[..., 2 * inner_per_group + 2 * state_dim:]  # [s, b, groups, heads per group]
    kernel = params["conv1d.weight"][:, 0]  # [channels, k]
    width = kernel.shape[1]
    conv = torch.stack([params["conv1d.bias"] + sum(kernel[:, k] * xbc[t - width + 1 + k]
                                                    for k in range(width) if t - width + 1 + k >= 0)
                        for t in range(SEQ)])
    conv = F.silu(conv).reshape(SEQ, BATCH, groups, -1)
    x = conv[..., :inner_per_group].reshape(SEQ, BATCH, groups, heads_per_group, head_dim)
    B, C = conv[..., inner_per_group:inner_per_group + state_dim], conv[..., inner_per_group + state_dim:]
    A = -torch.exp(params["A_log"]).reshape(groups, heads_per_group)
    D = params["D"].reshape(groups, heads_per_group)
    dt = F.softplus(dt_raw + params["dt_bias"].reshape(groups, heads_per_group))
    y = torch.zeros(SEQ, BATCH, groups, heads_per_group, head_dim, dtype=torch.float64)
    for b in range(BATCH):
        for g in range(groups):
            for h in range(heads_per_group):
                state = torch.zeros(head_dim, state_dim, dtype=torch.float64)
                for t in range(SEQ):
                    step = dt[t, b, g, h]
                    state = torch.exp(step * A[g, h]) * state + step * torch.outer(x[t, b, g, h], B[t, b, g])
                    y[t, b, g, h] = state @ C[t, b, g] + D[g, h] * x[t, b, g, h]
    gated = y.reshape(SEQ, BATCH, groups, inner_per_group) * F.silu(z)
    normed = gated / torch.sqrt(gated.pow(2).mean(-1, keepdim=True) + 1e-5)
    normed = normed.reshape(SEQ, BATCH, -1) * params["norm.weight"]
    return normed @ params["out_proj.weight"].T


def test_mixer_computes_the_mamba2_formulas():
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    mixer = MambaMixer(_config(), layer_number=1, init_seed=11)
    with torch.no_grad():  # a visible skip term and norm weight (initialised to ones)
        mixer.D.normal_(generator=torch.Generator().manual_seed(2))
        mixer.norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(3))
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(4))
    output, bias = mixer(hidden)
    assert bias is None and output.shape == (SEQ, BATCH, HIDDEN)
    expected = reference_mixer(mixer, hidden)
    torch.testing.assert_close(output.double(), expected, rtol=0, atol=1e-5 * expected.abs().max().item())


def test_parameter_shapes_names_and_initial_values():
    mixer = MambaMixer(_config(), layer_number=1, init_seed=11)
    shapes = {name: tuple(param.shape) for name, param in mixer.named_parameters()}
    # Per group: z 16, x 16, B 3, C 3, dt 4 rows; 8 heads; conv channels x, B, C per group (22 each).
    assert shapes == {"A_log": (8,), "D": (8,), "dt_bias": (8,), "conv1d.weight": (44, 1, 4), "conv1d.bias": (44,),
                      "norm.weight": (32,), "in_proj.weight": (84, 16), "out_proj.weight": (16, 32)}
    A = torch.exp(mixer.A_log.detach())
    assert ((1 <= A) & (A <= 16)).all() and torch.equal(mixer.D.detach(), torch.ones(8))
    dt = F.softplus(mixer.dt_bias.detach())
    assert ((1e-3 - 1e-7 <= dt) & (dt <= 0.1 + 1e-7)).all()
    assert mixer.conv1d.weight.abs().max() <= 1 / math.sqrt(4)
    again = MambaMixer(_config(), layer_number=1, init_seed=11)
    assert all(torch.equal(a, b) for a, b in zip(mixer.parameters(), again.parameters()))
    other = MambaMixer(_config(), layer_number=1, init_seed=12)
    assert not torch.equal(mixer.A_log, other.A_log) and not torch.equal(mixer.in_proj.weight, other.in_proj.weight)


@pytest.mark.parametrize("overrides, message", [
    (dict(mamba_num_groups=3), r"the 8 Mamba heads must divide into --mamba-num-groups 3"),
    (dict(mamba_head_dim=5), r"2 x --hidden-size \(32\) must be a multiple of --mamba-head-dim 5"),
    (dict(hybrid_layer_pattern="MX"), r"must give one of M, \*, -, E .* for each of the --num-layers 1 layers"),
    (dict(context_parallel_size=4, num_layers=2, hybrid_layer_pattern="M*"),
     r"--mamba-num-groups 2 must be a multiple of --tensor-model-parallel-size 1 x --context-parallel-size 4"),
    (dict(mtp_num_layers=1), r"--mtp-num-layers is not supported by hybrid models"),
    (dict(mtp_num_layers=1, hybrid_layer_pattern="*"), r"--mtp-num-layers is not supported by hybrid models"),
])
def test_config_rules(overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(**overrides)


def _run(mixer, hidden, upstream):
    hidden = hidden.clone().requires_grad_()
    output, _ = mixer(hidden)
    (output * upstream).sum().backward()
    return output.detach(), hidden.grad, {name: param.grad for name, param in mixer.named_parameters()}


def _tensor_parallel_worst(sequence_parallel):
    generator = torch.Generator().manual_seed(0)
    hidden, upstream = (torch.randn(SEQ + 1, BATCH, HIDDEN, generator=generator) for _ in range(2))
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    reference = _run(MambaMixer(_config(), 1, init_seed=11), hidden, upstream)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    rank = parallel_state.get_tensor_model_parallel_rank()
    local = (lambda t: t.chunk(2)[rank]) if sequence_parallel else (lambda t: t)
    mixer = MambaMixer(_config(tensor_model_parallel_size=2, sequence_parallel=sequence_parallel), 1, init_seed=11)
    output, hidden_grad, grads = _run(mixer, local(hidden), local(upstream))
    worst = max((output - local(reference[0])).abs().max().item(),
                (hidden_grad - local(reference[1])).abs().max().item())
    for name, param in mixer.named_parameters():
        expected = reference[2][name].chunk(2, dim=param.partition_dim)[rank]
        assert param.grad.shape == expected.shape, name
        worst = max(worst, ((param.grad - expected).abs().max() / expected.abs().max().clamp(min=1)).item())
    parallel_state.destroy_model_parallel()
    return worst


def _context_parallel_worst(packed):
    """The mixer at CP=2 (each rank two chunks of the sequence, or with `packed` two chunks of every packed
    sequence) against one rank on the whole sequence."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.packed_sequences import thd_local_indices
    from megatron.core.transformer.context_parallel.sequence_split import local_token_indices

    length = 16
    generator = torch.Generator().manual_seed(1)
    hidden, upstream = (torch.randn(length, 1, HIDDEN, generator=generator) for _ in range(2))
    params = None
    if packed:  # sequences of 5 and 6 tokens at offsets 0 and 8 (spans of 8: multiples of 2 x CP)
        offsets, padded = torch.tensor([0, 5, 11], dtype=torch.int32), torch.tensor([0, 8, 16], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=offsets, cu_seqlens_kv=offsets,
                                 cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded, max_seqlen_q=6,
                                 max_seqlen_kv=6)
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    # Two layers ('M*'): a CP config needs an attention layer to split; the output projection's init depends on it.
    reference = _run_packed(MambaMixer(_config(num_layers=2, hybrid_layer_pattern="M*"), 1, init_seed=11), hidden,
                            upstream, params)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    rank = parallel_state.get_context_parallel_rank()
    rows = thd_local_indices(params, length, 2, rank) if packed else local_token_indices(length, 2, rank)
    mixer = MambaMixer(_config(context_parallel_size=2, num_layers=2, hybrid_layer_pattern="M*"), 1, init_seed=11)
    output, hidden_grad, grads = _run_packed(mixer, hidden[rows], upstream[rows], params)
    worst = max((output - reference[0][rows]).abs().max().item(),
                (hidden_grad - reference[1][rows]).abs().max().item())
    for name, param in mixer.named_parameters():
        total = param.grad.clone()
        torch.distributed.all_reduce(total, group=parallel_state.get_context_parallel_group())
        expected = reference[2][name]
        worst = max(worst, ((total - expected).abs().max() / expected.abs().max().clamp(min=1)).item())
    parallel_state.destroy_model_parallel()
    return worst


def _run_packed(mixer, hidden, upstream, params):
    hidden = hidden.clone().requires_grad_()
    output, _ = mixer(hidden, packed_seq_params=params)
    (output * upstream).sum().backward()
    return output.detach(), hidden.grad, {name: param.grad for name, param in mixer.named_parameters()}


def _tensor_parallel_differences():
    return [_tensor_parallel_worst(sequence_parallel) for sequence_parallel in (False, True)] + [
        _context_parallel_worst(packed) for packed in (False, True)]


def test_tensor_and_context_parallel_equal_one_rank():
    """TP2, TP2 + SP, CP2 and CP2 on packed sequences: outputs, input gradients and parameter gradients (summed
    over the context-parallel ranks, which each scan a share of the groups) equal one rank's."""
    for differences in run_on_ranks(2, _tensor_parallel_differences):
        assert max(differences) < 1e-5, differences

"""Sliding-window attention and attention sinks in multi-latent attention: the layer against a reference written
here on its own queries, keys and values (output and the sinks' gradient), the logit tracking of QK-Clip inside the
window only, and a GPT of MLA layers at CP2 (every comm type) against CP1."""

import math

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.attention_variants import window_blocked
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.multiprocess_harness import run_on_ranks

SEQ, BATCH, HIDDEN, HEADS = 8, 2, 32, 4
SHAPE = dict(kv_lora_rank=12, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=10)
OFFSETS = torch.tensor([0.5, -1.0, 2.0, 0.0])
# YaRN's mscale^2 makes MLA's softmax scale differ from 1 / sqrt(query width): the sinks path must keep it.
YARN = dict(rope_type="yarn", rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=0.8,
            original_max_position_embeddings=256)


def _summed(output_and_bias):
    """An attention's `(output, bias)` (upstream's return) -> output + bias, what the layer adds to the residual."""
    output, bias = output_and_bias
    return output if bias is None else output + bias


def mla_config(**overrides):
    fields = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0,
                  attention_dropout=0.0, multi_latent_attention=True, rope_type="rope", init_method_std=0.3, **SHAPE)
    fields.update(overrides)
    return TransformerConfig(**fields)


def _layer_and_inputs(**overrides):
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    layer = MLASelfAttention(mla_config(**overrides), layer_number=1)
    if layer.softmax_offset is not None:
        with torch.no_grad():
            layer.softmax_offset.copy_(OFFSETS)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(4))
    return layer, hidden


def _query_key_value(layer, hidden):
    """The layer's own `[S, b, heads, d]` queries, keys and values (after the latents, norms and RoPE)."""
    query_input, kv_latent, k_rope = layer._down_projections(hidden)
    angles = layer._rotary_angles(k_rope.shape[0], k_rope.device)
    return layer._up_projections(query_input, kv_latent, k_rope, angles)


def _reference_context(query, key, value, scale, window, sinks):
    """float64, one query at a time: p_ij = exp(l_ij) / (exp(sink_h) + sum over visible k of exp(l_ik)), query i
    seeing keys j <= i, and j >= i - left with a window."""
    query, key, value = (t.double().permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
    rows = []
    for i in range(SEQ):
        visible = [j for j in range(SEQ) if j <= i and (window is None or j >= i - window[0])]
        logits = (query[:, :, i:i + 1] * key[:, :, visible]).sum(-1) * scale  # [b, h, visible]
        weights = logits.exp()
        denominator = weights.sum(-1, keepdim=True)
        if sinks is not None:
            denominator = denominator + sinks.double().exp().view(1, HEADS, 1)
        rows.append(((weights / denominator).unsqueeze(-1) * value[:, :, visible]).sum(2))
    return torch.stack(rows).reshape(SEQ, BATCH, -1)  # [s, b, h * dv]


@pytest.mark.parametrize("overrides", [dict(window_size=(2, 0)), dict(softmax_type="off-by-one"),
                                       dict(window_size=(3, 0), softmax_type="learnable", **YARN)],
                         ids=["window", "off_by_one", "window_learnable"])
def test_mla_equals_the_reference(overrides):
    layer, hidden = _layer_and_inputs(**overrides)
    assert layer.window_size == overrides.get("window_size")
    if "rope_type" in overrides:
        width = SHAPE["qk_head_dim"] + SHAPE["qk_pos_emb_head_dim"]
        assert abs(layer.softmax_scale * math.sqrt(width) - 1.0) > 0.05
    output, bias = layer(hidden)  # (output, bias) as upstream
    assert bias is layer.linear_proj.bias
    output = output + bias
    query, key, value = (t.detach() for t in _query_key_value(layer, hidden))
    sinks = {"vanilla": None, "off-by-one": torch.zeros(HEADS),
             "learnable": OFFSETS.double().requires_grad_()}[layer.config.softmax_type]
    context = _reference_context(query, key, value, layer.softmax_scale, layer.window_size, sinks)
    weight = layer.linear_proj.weight.detach().double()
    expected = context @ weight.T + layer.linear_proj.bias.detach().double()
    torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)
    plain_layer, _ = _layer_and_inputs(**{k: v for k, v in overrides.items() if k in YARN})
    assert (output - _summed(plain_layer(hidden))).abs().max() > 1e-2  # the variant changes the result
    if layer.softmax_offset is not None:
        upstream = torch.randn(output.shape, generator=torch.Generator().manual_seed(7))
        output.backward(upstream)
        expected.backward(upstream.double())
        assert sinks.grad.abs().min() > 1e-4
        torch.testing.assert_close(layer.softmax_offset.grad.double(), sinks.grad, atol=1e-5, rtol=1e-5)


def test_mla_learnable_sinks_parameter():
    layer, _ = _layer_and_inputs(softmax_type="learnable", window_size=(2, 0), window_attn_skip_freq=2)
    offset = dict(layer.named_parameters())["softmax_offset"]
    assert offset.shape == (HEADS,) and offset.tensor_model_parallel and offset.partition_dim == 0
    layer.reset_parameters()
    assert torch.equal(offset, torch.zeros(HEADS))
    # window_attn_skip_freq 2: layer 2 attends fully.
    assert MLASelfAttention(layer.config, layer_number=2).window_size is None


def test_mla_logit_tracking_counts_only_keys_inside_the_window():
    from megatron.core.transformer.attention_logits import max_attention_logits

    maxima = []
    for window in ((1, 0), None):
        layer, hidden = _layer_and_inputs(window_size=window, log_max_attention_logit=True)
        layer(hidden)
        maxima.append(layer.max_attention_logits)
    query, key, _ = _query_key_value(layer, hidden)
    blocked = window_blocked(torch.arange(SEQ), torch.arange(SEQ), (1, 0))
    torch.testing.assert_close(maxima[0], max_attention_logits(query, key, blocked, scale=layer.softmax_scale))
    assert (maxima[1] > maxima[0] + 1e-4).any()  # keys outside the window held larger logits


def _mla_cp2_equals_cp1(window_size, softmax_type):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.context_parallel import local_rows

    seq, vocab = 16, 64
    cp_size, cp_rank = dist.get_world_size(), dist.get_rank()
    parallel_state.initialize_model_parallel(context_parallel_size=cp_size,
                                             hierarchical_context_parallel_sizes=[1, cp_size])
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    try:
        def gpt(cp):
            config = mla_config(num_layers=4, init_seed=1234, init_method_std=0.02, context_parallel_size=cp,
                                cp_comm_type=["p2p", "allgather", "a2a", "a2a+p2p"] if cp > 1 else "p2p",
                                hierarchical_context_parallel_sizes=(1, cp) if cp > 1 else None,
                                window_size=window_size, softmax_type=softmax_type)
            return GPTModel(config, vocab_size=vocab, max_sequence_length=seq, position_embedding_type="rope",
                            share_embeddings_and_output_weights=True)

        stream = torch.randint(0, vocab, (BATCH, seq + 1), generator=torch.Generator().manual_seed(0))
        tokens, labels, positions = stream[:, :-1], stream[:, 1:], torch.arange(seq).expand(BATCH, -1)
        reference, model = gpt(1), gpt(cp_size)
        with torch.no_grad():
            for name, param in reference.named_parameters():
                if name.endswith("softmax_offset"):
                    param.copy_(OFFSETS)
        model.load_state_dict(reference.state_dict())
        reference(tokens, positions, labels=labels).sum().backward()
        local = [local_rows(t, 1, cp_size, cp_rank) for t in (tokens, positions, labels)]
        losses = model(local[0], local[1], labels=local[2])
        loss = losses.detach().sum()
        losses.sum().backward()
        dist.all_reduce(loss)
        errors, sink_grads = {}, []
        for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
            grad = param.grad.clone()
            dist.all_reduce(grad)
            errors[name] = (grad - expected.grad).abs().max().item()
            if name.endswith("softmax_offset"):
                sink_grads.append(expected.grad.abs().min().item())
        full = reference(tokens, positions, labels=labels).detach().sum()
        return loss.item(), full.item(), max(errors.values()), sink_grads
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("window_size, softmax_type", [((3, 0), "learnable"), (None, "learnable"),
                                                       ((3, 0), "vanilla")])
def test_mla_window_and_sinks_under_context_parallelism_equal_cp1(world_size, window_size, softmax_type):
    for loss, reference, grad_error, sink_grads in run_on_ranks(world_size, _mla_cp2_equals_cp1, window_size,
                                                                softmax_type):
        assert abs(loss - reference) < 1e-5 * abs(reference) and grad_error < 1e-5, (loss, reference, grad_error)
        assert len(sink_grads) == (4 if softmax_type == "learnable" else 0)
        assert all(grad > 1e-7 for grad in sink_grads), sink_grads


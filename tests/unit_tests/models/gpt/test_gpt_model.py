"""GPTModel: the loss equals an independent plain-torch transformer, and tensor parallelism (with and without
sequence parallelism, for every MLP / norm / attention / position-embedding variant) reproduces TP=1 loss and
gradients."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.activations import squared_relu
from tests.unit_tests.models.gpt.gpt_test_utils import (
    VOCAB_SIZE,
    fixed_batch,
    reference_then_parallel,
    seeded_model,
    tiny_config,
)
from tests.unit_tests.multiprocess_harness import run_on_ranks

LOSS_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-5

VARIANTS = {
    "gelu_layernorm_learned_tied": ({}, {}),
    "swiglu_rmsnorm_rope": (
        {"gated_linear_unit": True, "normalization": "RMSNorm", "ffn_hidden_size": 48},
        {"position_embedding_type": "rope"},
    ),
    "untied": ({}, {"share_embeddings_and_output_weights": False}),
    # NoPE: no position table and no rotation; only the causal mask orders the tokens.
    "swiglu_rmsnorm_no_position_embedding": (
        {"gated_linear_unit": True, "normalization": "RMSNorm", "ffn_hidden_size": 48},
        {"position_embedding_type": "none"},
    ),
    # Llama-style: grouped-query attention (2 key/value heads for 4 query heads), query/key norms, zero-centred
    # norm weights, partial rotary embeddings.
    "gqa_qknorm_1p_rope_partial": (
        {"gated_linear_unit": True, "normalization": "RMSNorm", "ffn_hidden_size": 48, "num_query_groups": 2,
         "qk_layernorm": True, "layernorm_zero_centered_gamma": True},
        {"position_embedding_type": "rope", "rotary_percent": 0.5},
    ),
    "squared_relu_layernorm_1p_mqa": (
        {"activation_func": squared_relu, "layernorm_zero_centered_gamma": True, "num_query_groups": 1,
         "qk_layernorm": True},
        {},
    ),
}


# --------------------------------------------------------------------------------------------------------
# An independent reference: the same network written out with plain tensor operations
# --------------------------------------------------------------------------------------------------------


def _norm(x, params, prefix, config):
    weight = params[f"{prefix}.weight"]
    if config.layernorm_zero_centered_gamma:
        weight = weight + 1
    if config.normalization == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.layernorm_epsilon) * weight
    mean = x.mean(-1, keepdim=True)
    variance = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(variance + config.layernorm_epsilon) * weight + params[f"{prefix}.bias"]


def _rope_as_complex_rotation(x, base, rotary_percent=1.0):
    """RoPE via complex numbers: channel i and i + d/2 form z_i, multiplied by exp(i * pos * base^(-2i/d)), for the
    first d = rotary_percent * head_dim channels; the others pass through."""
    rot_dim = int(x.shape[-1] * rotary_percent)
    if rot_dim < x.shape[-1]:
        return torch.cat((_rope_as_complex_rotation(x[..., :rot_dim], base), x[..., rot_dim:]), dim=-1)
    seq, half = x.shape[-2], x.shape[-1] // 2
    frequencies = base ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * frequencies[None, :]
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.polar(torch.ones_like(angles), angles)
    return torch.cat((z.real, z.imag), dim=-1).to(x.dtype)


def _reference_per_token_loss(params, config, tokens, labels, position_ids, rope_base=None, tied=True,
                              rotary_percent=1.0, learned_positions=True):
    heads, head_dim, groups = config.num_attention_heads, config.kv_channels, config.num_query_groups
    per_group = heads // groups
    batch, seq = tokens.shape
    x = params["embedding.word_embeddings.weight"][tokens]
    if learned_positions:
        x = x + params["embedding.position_embeddings.weight"][position_ids]
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
    for index in range(config.num_layers):
        prefix = f"decoder.layers.{index}"

        def linear(h, name):
            return h @ params[f"{prefix}.{name}.weight"].T + params[f"{prefix}.{name}.bias"]

        qkv = linear(_norm(x, params, f"{prefix}.input_layernorm", config), "self_attention.linear_qkv")
        # Per query group: its queries, then its key, then its value.
        qkv = qkv.view(batch, seq, groups, per_group + 2, head_dim).permute(0, 2, 3, 1, 4)  # [b, g, m+2, s, d]
        query = qkv[:, :, :per_group].reshape(batch, heads, seq, head_dim)
        # Query head i attends with its group's key and value, group i // per_group.
        key = qkv[:, :, per_group].repeat_interleave(per_group, dim=1)
        value = qkv[:, :, per_group + 1].repeat_interleave(per_group, dim=1)
        if config.qk_layernorm:
            query = _norm(query, params, f"{prefix}.self_attention.q_layernorm", config)
            key = _norm(key, params, f"{prefix}.self_attention.k_layernorm", config)
        if rope_base is not None:
            query = _rope_as_complex_rotation(query, rope_base, rotary_percent)
            key = _rope_as_complex_rotation(key, rope_base, rotary_percent)
        scores = (query @ key.transpose(-1, -2)) / math.sqrt(head_dim)
        probabilities = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        context = (probabilities @ value).permute(0, 2, 1, 3).reshape(batch, seq, heads * head_dim)
        x = x + linear(context, "self_attention.linear_proj")

        fc1 = linear(_norm(x, params, f"{prefix}.pre_mlp_layernorm", config), "mlp.linear_fc1")
        if config.gated_linear_unit:
            gate, up = fc1[..., 0::2], fc1[..., 1::2]  # rows are interleaved per unit: gate_i, up_i
            activated = F.silu(gate) * up
        elif config.activation_func is squared_relu:
            activated = F.relu(fc1) ** 2
        else:
            activated = F.gelu(fc1)
        x = x + linear(activated, "mlp.linear_fc2")
    x = _norm(x, params, "decoder.final_layernorm", config)
    output_weight = params["embedding.word_embeddings.weight"] if tied else params["output_layer.weight"]
    logits = x @ output_weight.T
    return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), labels.reshape(-1), reduction="none").view(batch, seq)


def _model_matches_reference(config_overrides, model_kwargs):
    parallel_state.initialize_model_parallel()
    config = tiny_config(**config_overrides)
    model = seeded_model(config, **model_kwargs)
    tokens, labels, position_ids = fixed_batch()
    with torch.no_grad():
        loss = model(tokens, position_ids, labels=labels)
        logits = model(tokens, position_ids)
        params = {name: p.detach() for name, p in model.named_parameters()}
        position_embedding_type = model_kwargs.get("position_embedding_type", "learned_absolute")
        rope_base = 10000 if position_embedding_type == "rope" else None
        tied = model_kwargs.get("share_embeddings_and_output_weights", True)
        expected = _reference_per_token_loss(params, config, tokens, labels, position_ids, rope_base, tied,
                                             model_kwargs.get("rotary_percent", 1.0),
                                             learned_positions=position_embedding_type == "learned_absolute")
        # An explicit Megatron-style mask (True = masked) that is causal must give the causal result.
        causal_mask = torch.triu(torch.ones(1, 1, tokens.shape[1], tokens.shape[1], dtype=torch.bool), diagonal=1)
        masked_loss = model(tokens, position_ids, attention_mask=causal_mask, labels=labels)
    logits_loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), labels.reshape(-1), reduction="none")
    return {
        "loss_shape": tuple(loss.shape),
        "loss_dtype": str(loss.dtype),
        "logits_shape": tuple(logits.shape),
        "loss_vs_reference": (loss - expected).abs().max().item(),
        "logits_vs_loss": (logits_loss.view_as(loss) - loss).abs().max().item(),
        "explicit_mask_vs_causal": (masked_loss - loss).abs().max().item(),
        "mean_loss": loss.mean().item(),
    }


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("world_size", [1])
def test_loss_matches_plain_torch_reference(world_size, variant):
    config_overrides, model_kwargs = VARIANTS[variant]
    (result,) = run_on_ranks(world_size, _model_matches_reference, config_overrides, model_kwargs)
    assert result["loss_shape"] == (2, 8)
    assert result["loss_dtype"] == "torch.float32"
    assert result["logits_shape"] == (2, 8, VOCAB_SIZE)
    assert result["loss_vs_reference"] < LOSS_TOLERANCE
    assert result["logits_vs_loss"] < LOSS_TOLERANCE
    assert result["explicit_mask_vs_causal"] < LOSS_TOLERANCE
    # Initial loss of a near-uniform predictor over 64 tokens is about ln(64).
    assert abs(result["mean_loss"] - math.log(VOCAB_SIZE)) < 0.5


# --------------------------------------------------------------------------------------------------------
# Tensor parallelism reproduces TP=1
# --------------------------------------------------------------------------------------------------------


def _assert_equivalent(result):
    assert result["param_diff"] == 0.0, "initial weights must not depend on the tensor-parallel size"
    assert result["loss_diff"] < LOSS_TOLERANCE, result
    assert result["logits_diff"] < LOSS_TOLERANCE, result
    assert result["largest_grad"] > 1e-3, "gradients too small for the comparison to mean anything"
    assert result["grad_diff"] < GRAD_TOLERANCE, result


# Multi-query attention (one key/value head) cannot split over two tensor-parallel ranks (a config error).
TP2_VARIANTS = sorted(name for name, (config, _) in VARIANTS.items() if config.get("num_query_groups", 4) % 2 == 0)


@pytest.mark.parametrize("variant", TP2_VARIANTS)
@pytest.mark.parametrize("world_size", [2])
def test_tp2_matches_tp1_loss_and_full_gradients(world_size, variant):
    config_overrides, model_kwargs = VARIANTS[variant]
    for result in run_on_ranks(world_size, reference_then_parallel, 2, False, config_overrides, model_kwargs):
        _assert_equivalent(result)


@pytest.mark.parametrize("variant", ["gelu_layernorm_learned_tied", "swiglu_rmsnorm_rope", "gqa_qknorm_1p_rope_partial"])
@pytest.mark.parametrize("world_size", [2])
def test_sequence_parallel_tp2_matches_tp1(world_size, variant):
    config_overrides, model_kwargs = VARIANTS[variant]
    for result in run_on_ranks(world_size, reference_then_parallel, 2, True, config_overrides, model_kwargs):
        _assert_equivalent(result)


@pytest.mark.parametrize("world_size", [4])
def test_tp4_matches_tp1(world_size):
    for sequence_parallel in (False, True):
        for result in run_on_ranks(world_size, reference_then_parallel, 4, sequence_parallel, {}, {}):
            _assert_equivalent(result)


# --------------------------------------------------------------------------------------------------------
# Reduced precision and deferred (meta-device) initialisation
# --------------------------------------------------------------------------------------------------------


def _bf16_close_to_fp32():
    parallel_state.initialize_model_parallel()
    tokens, labels, position_ids = fixed_batch()
    fp32_model = seeded_model(tiny_config())
    bf16_model = seeded_model(tiny_config(bf16=True, params_dtype=torch.bfloat16))
    fp32_loss = fp32_model(tokens, position_ids, labels=labels)
    bf16_loss = bf16_model(tokens, position_ids, labels=labels)
    bf16_loss.sum().backward()
    return {
        "param_dtypes": sorted({str(p.dtype) for p in bf16_model.parameters()}),
        "loss_dtype": str(bf16_loss.dtype),
        "relative_loss_diff": ((bf16_loss - fp32_loss).abs() / fp32_loss.abs()).max().item(),
        "grads_finite": all(torch.isfinite(p.grad).all().item() for p in bf16_model.parameters()),
    }


@pytest.mark.parametrize("world_size", [1])
def test_bf16_model_runs_and_tracks_fp32(world_size):
    (result,) = run_on_ranks(world_size, _bf16_close_to_fp32)
    assert result["param_dtypes"] == ["torch.bfloat16"]
    assert result["loss_dtype"] == "torch.float32"
    assert result["relative_loss_diff"] < 2e-2
    assert result["grads_finite"]


def _meta_then_materialise_equals_direct_init():
    parallel_state.initialize_model_parallel()
    direct = seeded_model(tiny_config(), position_embedding_type="learned_absolute")
    deferred = seeded_model(tiny_config(init_model_with_meta_device=True))
    all_meta = all(p.is_meta for p in deferred.parameters())
    deferred.to_empty(device="cpu")
    torch.manual_seed(1234)  # the generator state `seeded_model` starts from
    for module in deferred.modules():  # construction order, so the random stream is consumed identically
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    direct_params = dict(direct.named_parameters())
    return all_meta, max((p - direct_params[n]).abs().max().item() for n, p in deferred.named_parameters())


@pytest.mark.parametrize("world_size", [1])
def test_meta_device_construction_materialises_to_the_same_weights(world_size):
    (result,) = run_on_ranks(world_size, _meta_then_materialise_equals_direct_init)
    all_meta, difference = result
    assert all_meta
    assert difference == 0.0

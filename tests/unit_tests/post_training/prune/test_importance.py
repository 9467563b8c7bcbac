"""megatron.core.post_training.prune.importance: the scores equal a by-hand forward pass of a one-layer GPT (mean
absolute FFN activation, head output and norm output over the calibration tokens), and models the width pruning
does not handle are refused with the flag to change."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron.core.post_training.prune import check_prunable, collect_width_importance
from tests.unit_tests.post_training.prune import tiny_gpt

# The hooks and the by-hand forward pass run the same fp32 kernels on the same values; they differ only in the
# order of the final sums over 2 x 16 tokens (double in the hooks, float here).
TOLERANCE = 1e-6


def _by_hand(model, batches):
    """(ffn, heads, hidden) mean |activation| scores of a one-layer, no-bias, learned-position SwiGLU GPT."""
    config = model.config
    layer = model.decoder.layers[0]
    heads, head_dim = config.num_attention_heads, config.kv_channels
    ffn_sum, head_sum, hidden_sum, tokens = 0, 0, 0, 0
    for input_ids, _, positions in batches:
        x = model.embedding.word_embeddings.weight[input_ids] + model.embedding.position_embeddings.weight[positions]
        normed = F.rms_norm(x, (config.hidden_size,), layer.input_layernorm.weight, config.layernorm_epsilon)
        qkv = (normed @ layer.self_attention.linear_qkv.weight.T).view(*x.shape[:2], heads, 3, head_dim)
        query, key, value = (qkv[..., i, :].transpose(1, 2) for i in range(3))  # [b, heads, s, d]
        scores = query @ key.transpose(-1, -2) / head_dim ** 0.5
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        context = scores.masked_fill(causal, float("-inf")).softmax(-1) @ value  # [b, heads, s, d]
        context = context.transpose(1, 2)  # [b, s, heads, d]
        x = x + context.reshape(*x.shape[:2], -1) @ layer.self_attention.linear_proj.weight.T
        mlp_in = F.rms_norm(x, (config.hidden_size,), layer.pre_mlp_layernorm.weight, config.layernorm_epsilon)
        gate_up = (mlp_in @ layer.mlp.linear_fc1.weight.T).view(*x.shape[:2], -1, 2)
        intermediate = F.silu(gate_up[..., 0]) * gate_up[..., 1]
        ffn_sum = ffn_sum + intermediate.abs().sum(dim=(0, 1))
        head_sum = head_sum + context.abs().sum(dim=(0, 1, 3))
        hidden_sum = hidden_sum + normed.abs().sum(dim=(0, 1)) + mlp_in.abs().sum(dim=(0, 1))
        tokens += input_ids.numel()
    return ffn_sum / tokens, head_sum / (tokens * head_dim), hidden_sum / tokens


def test_scores_equal_a_forward_pass_by_hand():
    config = tiny_gpt.tiny_config(num_layers=1, add_bias_linear=False)
    model = tiny_gpt.tiny_gpt(config).eval()
    batches = [tiny_gpt.batch(step) for step in range(2)]
    importance = collect_width_importance(model, tiny_gpt.forward_loop(batches))
    with torch.no_grad():
        ffn, heads, hidden = _by_hand(model, batches)
    assert importance.ffn[0].shape == (64,) and importance.heads[0].shape == (4,) and importance.hidden.shape == (32,)
    torch.testing.assert_close(importance.ffn[0], ffn, rtol=TOLERANCE, atol=TOLERANCE)
    torch.testing.assert_close(importance.heads[0], heads, rtol=TOLERANCE, atol=TOLERANCE)
    torch.testing.assert_close(importance.hidden, hidden, rtol=TOLERANCE, atol=TOLERANCE)
    assert float(ffn.max() / ffn.min()) > 2  # the scores tell neurons apart: a real ranking is under test
    assert not any(hook for module in model.modules()
                   for hook in (module._forward_hooks, module._forward_pre_hooks))  # all removed


def test_no_forward_pass_means_no_scores():
    model = tiny_gpt.tiny_gpt()
    with pytest.raises(RuntimeError, match="ran no forward pass"):
        collect_width_importance(model, lambda _: None)


@pytest.mark.parametrize("overrides,message", [
    ({"tensor_model_parallel_size": 2}, "--tensor-model-parallel-size 1"),
    ({"pipeline_model_parallel_size": 2}, "--pipeline-model-parallel-size 1"),
    ({"num_moe_experts": 2}, "--num-experts"),
    ({"multi_latent_attention": True}, "--multi-latent-attention"),
    ({"attention_output_gate": True}, "--attention-output-gate"),
    ({"mtp_num_layers": 1}, "--mtp-num-layers"),
    ({"softmax_type": "learnable"}, "--softmax-type learnable"),
    ({"hybrid_layer_pattern": "M*"}, "--hybrid-override-pattern"),
])
def test_unsupported_models_are_refused_with_the_flag(overrides, message):
    model = tiny_gpt.tiny_gpt()
    # Only the config is read before refusing: a config that would not build in this world is enough.
    config = dataclasses.replace(model.config)
    for name, value in overrides.items():
        object.__setattr__(config, name, value)  # the frozen config, bypassing the checks of this world's sizes
    model.config = config
    with pytest.raises(ValueError, match=message):
        check_prunable(model)


def test_norms_fused_into_transformer_engine_linears_are_refused():
    model = tiny_gpt.tiny_gpt()
    model.decoder.layers[1].norms_fused_into_linears = True  # as under --transformer-impl transformer_engine
    with pytest.raises(ValueError, match="--transformer-impl local"):
        check_prunable(model)


def test_wrapped_models_are_refused():
    with pytest.raises(ValueError, match="unwrapped GPTModel"):
        check_prunable(torch.nn.Linear(2, 2))

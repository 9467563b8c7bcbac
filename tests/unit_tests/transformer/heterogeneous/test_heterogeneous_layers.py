"""A heterogeneous GPT against the formulas written out: each layer's grouped-query attention with its own key/value
heads, its own MLP width, a dropped attention or MLP (the residual passes through, no norm), and the linear
stand-ins (h + W norm(h)). The reference reads the model's weights and computes in float64."""

import json

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.heterogeneous.linear_replacements import LinearReplacedAttention, LinearReplacedMLP
from megatron.core.transformer.mlp import MLP
from tests.unit_tests.models.gpt.gpt_test_utils import fixed_batch, seeded_model, tiny_config

HIDDEN, HEADS, HEAD_DIM, EPS = 64, 4, 16, 1e-5
# (query groups or "none" / "linear", MLP width or "none" / "linear") per layer; ffn_mult 2.0 -> 256, 7.0 -> 512.
BLOCK_CONFIGS = [
    {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}},
    {"attention": {"no_op": True}, "ffn": {"replace_with_linear": True}},
    {"attention": {"replace_with_linear": True}, "ffn": {"ffn_mult": 7.0}},
    {"attention": {"n_heads_in_group": 1}, "ffn": {"no_op": True}},
]


def _model():
    config = tiny_config(num_layers=4, hidden_size=HIDDEN, num_attention_heads=HEADS, normalization="RMSNorm",
                         gated_linear_unit=True, add_bias_linear=False, init_method_std=0.1,
                         heterogeneous_layers_config_encoded_json=json.dumps({"block_configs": BLOCK_CONFIGS}))
    return seeded_model(config, position_embedding_type="none")


def _rms(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def _attention(x, qkv_weight, proj_weight, groups):
    """Causal attention of `x` `[s, b, h]`; the fused rows are per group (q_0 .. q_{m-1}, k, v), head_dim each."""
    per_group = HEADS // groups
    rows = qkv_weight.view(groups, per_group + 2, HEAD_DIM, HIDDEN)
    q = torch.einsum("sbh,gmdh->bgmsd", x, rows[:, :per_group])
    k = torch.einsum("sbh,gdh->bgsd", x, rows[:, per_group])
    v = torch.einsum("sbh,gdh->bgsd", x, rows[:, per_group + 1])
    scores = torch.einsum("bgmsd,bgtd->bgmst", q, k) / HEAD_DIM ** 0.5
    seq = x.shape[0]
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    heads = torch.einsum("bgmst,bgtd->sbgmd", scores.softmax(-1), v).reshape(seq, x.shape[1], HEADS * HEAD_DIM)
    return heads @ proj_weight.T


def _mlp(x, fc1_weight, fc2_weight):
    gate, up = fc1_weight[0::2], fc1_weight[1::2]  # rows interleaved per unit
    return (F.silu(x @ gate.T) * (x @ up.T)) @ fc2_weight.T


def _reference_logits(weights, tokens):
    w = {name: value.double() for name, value in weights.items()}

    def attention(h, layer, groups):
        return _attention(_rms(h, w[f"{layer}.input_layernorm.weight"]), w[f"{layer}.self_attention.linear_qkv.weight"],
                          w[f"{layer}.self_attention.linear_proj.weight"], groups)

    def mlp(h, layer):
        return _mlp(_rms(h, w[f"{layer}.pre_mlp_layernorm.weight"]), w[f"{layer}.mlp.linear_fc1.weight"],
                    w[f"{layer}.mlp.linear_fc2.weight"])

    h = w["embedding.word_embeddings.weight"][tokens].transpose(0, 1)  # [s, b, h]
    # Layer 1: attention with 2 query groups, an MLP of width 256.
    h = h + attention(h, "decoder.layers.0", groups=2)
    h = h + mlp(h, "decoder.layers.0")
    # Layer 2: no attention, a linear for the MLP.
    h = h + _rms(h, w["decoder.layers.1.pre_mlp_layernorm.weight"]) @ w["decoder.layers.1.mlp.linear_mlp.weight"].T
    # Layer 3: a linear for the attention, an MLP of width 512.
    h = h + (_rms(h, w["decoder.layers.2.input_layernorm.weight"])
             @ w["decoder.layers.2.self_attention.linear_attn.weight"].T)
    h = h + mlp(h, "decoder.layers.2")
    # Layer 4: multi-head attention (4 groups of one head), no MLP.
    h = h + attention(h, "decoder.layers.3", groups=4)
    h = _rms(h, w["decoder.final_layernorm.weight"])
    return (h @ w["embedding.word_embeddings.weight"].T).transpose(0, 1)


def test_each_layer_has_the_parameters_of_its_block_config():
    shapes = {name: tuple(p.shape) for name, p in _model().named_parameters() if name.startswith("decoder.layers.")}
    assert shapes == {
        "decoder.layers.0.input_layernorm.weight": (64,),
        "decoder.layers.0.self_attention.linear_qkv.weight": ((4 + 2 * 2) * 16, 64),
        "decoder.layers.0.self_attention.linear_proj.weight": (64, 64),
        "decoder.layers.0.pre_mlp_layernorm.weight": (64,),
        "decoder.layers.0.mlp.linear_fc1.weight": (2 * 256, 64),
        "decoder.layers.0.mlp.linear_fc2.weight": (64, 256),
        "decoder.layers.1.pre_mlp_layernorm.weight": (64,),
        "decoder.layers.1.mlp.linear_mlp.weight": (64, 64),
        "decoder.layers.2.input_layernorm.weight": (64,),
        "decoder.layers.2.self_attention.linear_attn.weight": (64, 64),
        "decoder.layers.2.pre_mlp_layernorm.weight": (64,),
        "decoder.layers.2.mlp.linear_fc1.weight": (2 * 512, 64),
        "decoder.layers.2.mlp.linear_fc2.weight": (64, 512),
        "decoder.layers.3.input_layernorm.weight": (64,),
        "decoder.layers.3.self_attention.linear_qkv.weight": ((4 + 2 * 4) * 16, 64),
        "decoder.layers.3.self_attention.linear_proj.weight": (64, 64),
    }


def test_the_model_computes_the_written_out_layers():
    model = _model()
    layers = model.decoder.layers
    assert isinstance(layers[1].mlp, LinearReplacedMLP) and layers[1].self_attention is None
    assert isinstance(layers[2].self_attention, LinearReplacedAttention) and isinstance(layers[2].mlp, MLP)
    assert layers[3].mlp is None
    tokens, _, position_ids = fixed_batch()
    logits = model(tokens, position_ids, attention_mask=None)
    expected = _reference_logits(model.state_dict(), tokens)
    torch.testing.assert_close(logits.double(), expected, rtol=0, atol=1e-5 * expected.abs().max().item())


def test_generation_through_the_key_value_cache_gives_the_full_forward_tokens():
    """Each attention layer caches its own key/value heads (2 and 4); the linear stand-ins cache nothing."""
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.static_generation import generate_static_batch

    model = _model().eval()
    prompts = [[5, 9, 2], [7, 1, 3, 3, 8, 4, 2]]
    results = generate_static_batch(model, prompts, SamplingParams(top_k=1, num_tokens_to_generate=6), eod_id=63,
                                    max_sequence_length=16, max_batch_size=2, vocab_size=64)
    for prompt, result in zip(prompts, results):
        tokens = list(prompt)
        with torch.no_grad():
            while len(tokens) < len(prompt) + len(result.generated_tokens):
                tokens.append(int(model(torch.tensor([tokens]), None, None)[0, -1].argmax()))
        assert result.generated_tokens == tokens[len(prompt):] and len(result.generated_tokens) >= 1


def test_upstreams_config_class_and_layer_spec_build_the_same_model():
    from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec
    from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig

    model = _model()
    fields = {name: getattr(model.config, name) for name in ("num_layers", "hidden_size", "num_attention_heads",
                                                             "normalization", "gated_linear_unit", "add_bias_linear",
                                                             "init_method_std", "hidden_dropout", "attention_dropout",
                                                             "heterogeneous_layers_config_encoded_json")}
    config = HeterogeneousTransformerConfig(**fields)
    spec = get_gpt_heterogeneous_layer_spec(config, use_te=False)
    upstream_style = seeded_model(config, transformer_layer_spec=spec, position_embedding_type="none")
    assert len(spec.layer_specs) == 4
    for (name, value), (other_name, other) in zip(model.state_dict().items(), upstream_style.state_dict().items()):
        assert name == other_name and torch.equal(value, other)
    with pytest.raises(ValueError, match="HeterogeneousTransformerConfig needs the layers"):
        HeterogeneousTransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)

"""SelfAttention's order of the per-head steps against a float64 reference written here: the head norms
(`--qk-layernorm`'s or `--qk-l2-norm`'s) come before the rotary embedding, as upstream, so YaRN's factor on cos and
sin (ms(s, mscale) / ms(s, mscale_all_dim)) scales the logits by its square."""

import math

import pytest
import torch

from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
from megatron.core.transformer.attention import SelfAttention
from tests.unit_tests.models.gpt.gpt_test_utils import tiny_config

SEQ, BATCH, HIDDEN, HEADS, HEAD_DIM = 6, 2, 32, 4, 8
YARN = dict(yarn_rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=64)


def _yarn_reference_angles(positions):
    """YaRN's frequencies for rot_dim 8, base 10000, s = 4, original context 64, beta 32 / 1, rounded bounds."""
    dim, base, factor = HEAD_DIM, 10000.0, 4.0
    rope = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)

    def bound(rotations):
        return dim * math.log(64 / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(bound(32.0)), 0), min(math.ceil(bound(1.0)), dim - 1)
    interpolated = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    frequencies = rope / factor * interpolated + rope * (1 - interpolated)
    return positions.double()[:, None] * frequencies[None]


def _reference(attention, hidden, scale):
    """Float64: split the fused rows per group [q_0, q_1, k, v], normalise each head (RMS, no weight), rotate
    (rotate-half, cos and sin times `scale`), causal softmax(q.k / sqrt(d)), output projection."""
    config = attention.config
    groups = config.num_query_groups
    per_group = HEADS // groups
    fused = hidden.double() @ attention.linear_qkv.weight.double().t() + attention.linear_qkv.bias.double()
    fused = fused.view(SEQ, BATCH, groups, (per_group + 2) * HEAD_DIM)
    query = fused[..., :per_group * HEAD_DIM].reshape(SEQ, BATCH, HEADS, HEAD_DIM)
    key = fused[..., per_group * HEAD_DIM:(per_group + 1) * HEAD_DIM].repeat_interleave(per_group, dim=2)
    value = fused[..., (per_group + 1) * HEAD_DIM:].repeat_interleave(per_group, dim=2)
    angles = _yarn_reference_angles(torch.arange(SEQ))[:, None, None, :]
    cos, sin = angles.cos() * scale, angles.sin() * scale

    def normalise_and_rotate(t):
        t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + config.layernorm_epsilon)
        first, second = t[..., :HEAD_DIM // 2], t[..., HEAD_DIM // 2:]
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

    query, key = normalise_and_rotate(query), normalise_and_rotate(key)
    scores = torch.einsum("sbnd,tbnd->bnst", query, key) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
    context = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), value).reshape(SEQ, BATCH, HEADS * HEAD_DIM)
    return context @ attention.linear_proj.weight.double().t() + attention.linear_proj.bias.double()


@pytest.mark.parametrize("head_norm", [dict(qk_l2_norm=True), dict(qk_layernorm=True, normalization="RMSNorm")])
def test_head_norms_precede_the_yarn_rotation(head_norm):
    config = tiny_config(num_query_groups=2, **YARN, **head_norm)
    scale = config.yarn_cos_sin_scale
    assert scale == pytest.approx(0.1 * math.log(4.0) + 1.0)  # ms(4, 1) / ms(4, 0): far enough from 1 to matter
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    attention = SelfAttention(config, layer_number=1).eval()
    with torch.no_grad():  # visible biases (zero-initialised otherwise)
        attention.linear_qkv.bias.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(5))
        attention.linear_proj.bias.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(6))
    rotary = YarnRotaryEmbedding(HEAD_DIM, scaling_factor=4.0, original_max_position_embeddings=64)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        output, bias = attention(hidden, rotary_pos_emb=rotary(SEQ)[0])  # (angles, mscale), as upstream
    assert bias is attention.linear_proj.bias  # returned, not added: (output, bias) as upstream
    torch.testing.assert_close((output + bias).double(), _reference(attention, hidden, scale), rtol=0, atol=1e-5)


def test_upstream_positional_submodules_are_refused_by_name():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    submodules = get_gpt_layer_local_spec().submodules  # None here: layers are built from the config
    message = (r"SelfAttention\(config, layer_number, ...\): layer_number must be the layer's 1-based number in the "
               r"whole model, got None; upstream's second argument, submodules, is not taken here")
    with pytest.raises(TypeError, match=message):
        SelfAttention(tiny_config(), submodules, 1)  # upstream's (config, submodules, layer_number)
    with pytest.raises(TypeError, match=r"layer_number must be the layer's 1-based number in the whole model, got 0"):
        SelfAttention(tiny_config(), 0)
    mla = MLATransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=8,
                               qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
    with pytest.raises(TypeError, match=r"^MLASelfAttention\(config, layer_number, ...\): .* got None"):
        MLASelfAttention(mla, submodules, 1)
    assert SelfAttention(tiny_config(), layer_number=2).layer_number == 2


def test_forward_takes_upstream_arguments_in_upstream_order():
    """Upstream: forward(hidden_states, attention_mask, key_value_states, inference_context, rotary_pos_emb, ...);
    the arguments this self-attention has no use for are refused by name."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    tensor_parallel.model_parallel_cuda_manual_seed(3)
    attention = SelfAttention(tiny_config(), layer_number=1).eval()
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(4))
    angles = RotaryEmbedding(HEAD_DIM)(SEQ)
    with torch.no_grad():
        output, bias = attention(hidden, None, None, None, angles)  # upstream's positional order
        keyword_output, _ = attention(hidden, rotary_pos_emb=angles)
        unrotated, _ = attention(hidden)
    torch.testing.assert_close(output, keyword_output, rtol=0, atol=0)
    assert bias is attention.linear_proj.bias
    assert not torch.allclose(output, unrotated, rtol=0, atol=1e-6)  # the angles went to rotary_pos_emb
    for name in ("key_value_states", "attention_bias", "rotary_pos_sin"):
        with pytest.raises(ValueError, match=rf"SelfAttention.forward\({name}=...\) is not supported: .* "
                                             rf"pass {name}=None"):
            attention(hidden, **{name: torch.zeros(1)})

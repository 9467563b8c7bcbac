"""YaRN for standard attention (`--position-embedding-type yarn`): the frequencies are multi-latent attention's for
the same settings and transformers' (truncated or not), cos and sin are scaled by ms(s, mscale) /
ms(s, mscale_all_dim), a GPT model with it computes what one with the scaled angles set by hand computes, it
splits over two tensor-parallel ranks as a TP1 model computes, and it trains at CP2 as at DP2. Decoding through the
key/value cache is in tests/unit_tests/inference/test_kv_cache_decoding.py, transformers' gpt-oss logits in
tests/unit_tests/tools/test_hf_gpt_oss.py."""

import math

import pytest
import torch

from megatron.core.models.common.embeddings.rotary_pos_embedding import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
from megatron.core.transformer.multi_latent_attention import build_mla_rotary_embedding
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.models.gpt.gpt_test_utils import fixed_batch, reference_then_parallel, seeded_model, tiny_config
from tests.unit_tests.multiprocess_harness import run_on_ranks

# 16 rotated channels, base 1e4, original context 256: the blend runs over pairs 0.21 .. 3.22 (0 .. 4 rounded).
SETTINGS = dict(scaling_factor=4.0, original_max_position_embeddings=256, beta_fast=32.0, beta_slow=1.0,
                mscale=1.0, mscale_all_dim=0.8)
# The GPT model's heads are 8 wide: with base 1e4 and an original context of 64 the blend covers pairs 0.35 .. 1.95.
GPT_YARN = dict(yarn_rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=64,
                yarn_correction_range_round_to_int=False)


def test_frequencies_are_multi_latent_attentions_and_transformers():
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    mla = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, multi_latent_attention=True,
                            kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=16, v_head_dim=8,
                            rotary_scaling_factor=4.0, original_max_position_embeddings=256, mscale_all_dim=0.8)
    mla_rotary, mla_scale = build_mla_rotary_embedding(mla)
    standard = YarnRotaryEmbedding(32, rotary_percent=0.5, **SETTINGS)  # 16 of 32 channels rotated
    assert torch.equal(standard.inverse_frequencies(), mla_rotary.inverse_frequencies())
    assert standard.cos_sin_scale == mla_scale == pytest.approx((0.1 * math.log(4) + 1) / (0.08 * math.log(4) + 1))
    for truncate in (True, False):
        hf = GptOssConfig(head_dim=16, num_attention_heads=2, hidden_size=32, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256, beta_fast=32.0,
            beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8, truncate=truncate))
        hf_frequencies, hf_factor = _compute_yarn_parameters(hf)
        ours = YarnRotaryEmbedding(16, **SETTINGS, correction_range_round_to_int=truncate)
        torch.testing.assert_close(ours.inverse_frequencies(), hf_frequencies, rtol=1e-6, atol=0)
        assert ours.cos_sin_scale == pytest.approx(hf_factor)
    # The fractional range moves the blend: pair 1 is 0.25 interpolated when rounded, (1 - 0.21) / 3.01 when not.
    rounded, fractional = (YarnRotaryEmbedding(16, **SETTINGS, correction_range_round_to_int=flag).inverse_frequencies()
                           for flag in (True, False))
    rope = 10000.0 ** (-2 / 16)
    assert rounded[1].item() == pytest.approx(rope * (0.75 + 0.25 / 4), rel=1e-6)
    share = (1 - 0.2124) / (3.2191 - 0.2124)
    assert fractional[1].item() == pytest.approx(rope * (1 - share + share / 4), rel=1e-3)


def test_cos_and_sin_are_scaled_by_the_attention_factor():
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, yarn_rotary_scaling_factor=32.0)
    assert config.yarn_cos_sin_scale == pytest.approx(0.1 * math.log(32) + 1)  # gpt-oss: 1.3466
    assert TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2).yarn_cos_sin_scale == 1.0
    t = torch.randn(5, 2, 3, 8, generator=torch.Generator().manual_seed(0))
    angles = YarnRotaryEmbedding(8, scaling_factor=32.0).angles(5)
    torch.testing.assert_close(apply_rotary_pos_emb(t, angles, mscale=1.5), 1.5 * apply_rotary_pos_emb(t, angles))


def test_a_call_returns_upstreams_angles_and_mscale():
    """As upstream, `emb, mscale = yarn(seq_len)`: the angles of every position (not a tensor that unpacks into
    rows) and ms(s, mscale) / ms(s, mscale_all_dim); the models' rotary angles are those angles, unchanged."""
    yarn = YarnRotaryEmbedding(16, **SETTINGS)
    output = yarn(6, offset=2)
    assert isinstance(output, tuple) and len(output) == 2
    emb, mscale = output
    assert mscale == yarn.cos_sin_scale == pytest.approx((0.1 * math.log(4.0) + 1) / (0.08 * math.log(4.0) + 1))
    positions = torch.arange(2.0, 8.0)
    half = torch.outer(positions, yarn.inverse_frequencies())
    assert emb.shape == (6, 1, 1, 16)
    assert torch.equal(emb, torch.cat((half, half), dim=-1)[:, None, None, :])
    assert torch.equal(yarn.angles(6, offset=2), emb)
    model = seeded_model(tiny_config(**GPT_YARN), position_embedding_type="yarn")
    tokens = fixed_batch(seq=16)[0]
    assert torch.equal(model._rotary_angles(tokens), model.rotary_pos_emb(16)[0])


def test_gpt_model_with_yarn_computes_the_scaled_rotation():
    """The model's YaRN equals a rope model whose angles are YaRN's and whose cos / sin carry the factor: a
    rotation scaled by f in q and in k multiplies the attention logits by f^2, which the rope model gets from
    query rows of linear_qkv multiplied by f^2."""
    yarn_config = tiny_config(init_method_std=0.3, **GPT_YARN)  # large weights: attention feels the positions
    factor = yarn_config.yarn_cos_sin_scale
    assert factor == pytest.approx(0.1 * math.log(4) + 1)
    tokens, _, positions = fixed_batch(seq=16)
    with torch.no_grad():
        yarn_model = seeded_model(yarn_config, position_embedding_type="yarn")
        assert isinstance(yarn_model.rotary_pos_emb, YarnRotaryEmbedding)
        yarn = yarn_model(tokens, positions)
        rope_model = seeded_model(tiny_config(init_method_std=0.3), position_embedding_type="rope")
        plain = rope_model(tokens, positions)
        rope_model.rotary_pos_emb.inverse_frequencies = yarn_model.rotary_pos_emb.inverse_frequencies
        heads, width = 4, 8
        for layer in rope_model.decoder.layers:
            qkv = layer.self_attention.linear_qkv  # rows [heads, (q | k | v), width]
            qkv.weight.view(heads, 3, width, -1)[:, 0] *= factor**2
            qkv.bias.view(heads, 3, width)[:, 0] *= factor**2
        by_hand = rope_model(tokens, positions)
    # Equal in exact arithmetic; in fp32 the factor is rounded in at different places (into cos and sin here, into
    # query weights as f^2 there), and the std-0.3 weights amplify those few ulps: 1.0e-5 to 1.5e-5 in logits up to
    # 7 measured with ATen's AVX-512, AVX2 and baseline kernels. A factor^2 off by 1e-5 moves the logits by 1e-4.
    torch.testing.assert_close(yarn, by_hand, rtol=1e-5, atol=5e-5)
    assert (yarn - plain).abs().max().item() > 0.05


def test_yarn_flags_need_the_yarn_position_embedding():
    with pytest.raises(ValueError, match="--yarn-rotary-scaling-factor shape.* need --position-embedding-type yarn"):
        seeded_model(tiny_config(yarn_rotary_scaling_factor=4.0), position_embedding_type="rope")
    with pytest.raises(ValueError, match="--yarn-beta-fast must be a positive number"):
        tiny_config(yarn_beta_fast=0.0)


@pytest.mark.parametrize("world_size", [2])
def test_tp2_matches_tp1(world_size):
    for result in run_on_ranks(world_size, reference_then_parallel, 2, True,
                               dict(GPT_YARN, num_query_groups=2), {"position_embedding_type": "yarn"}):
        assert result["param_diff"] == 0.0
        assert result["loss_diff"] < 1e-5 and result["logits_diff"] < 1e-5, result
        assert result["largest_grad"] > 1e-3 and result["grad_diff"] < 1e-5, result


YARN_FLAGS = ("--position-embedding-type yarn --yarn-rotary-scaling-factor 4 --yarn-original-max-position-embeddings 8 "
              "--no-yarn-correction-range-round-to-int --train-iters 3 --lr-decay-iters 3 --init-method-std 0.3")


def _pretrain(workdir, extra):
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import run_pretrain

    return run_pretrain(workdir, f"{YARN_FLAGS} {extra}")


@pytest.mark.world_size(2)
def test_context_parallel_training_matches_data_parallel(tmp_path):
    """pretrain() with YaRN at CP2 (each rank the angles of its two chunks' global positions) loses as at DP2,
    and otherwise than plain RoPE."""
    data_parallel = run_on_ranks(2, _pretrain, str(tmp_path), "")[0]
    context_parallel = run_on_ranks(2, _pretrain, str(tmp_path), "--context-parallel-size 2")[0]
    rope = run_on_ranks(2, _pretrain, str(tmp_path), "--yarn-rotary-scaling-factor 1")[0]  # plain RoPE
    for iteration, loss in data_parallel.items():
        assert context_parallel[iteration] == pytest.approx(loss, rel=0, abs=5e-6)  # measured: 3e-7
    assert abs(rope[1] - data_parallel[1]) > 1e-2  # measured: 0.027

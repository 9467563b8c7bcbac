"""TransformerConfig: derived defaults, init methods' statistics, and errors that name the flag to change."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

BASE = dict(num_layers=8, hidden_size=64, num_attention_heads=4)


def test_derived_defaults():
    config = TransformerConfig(**BASE)
    assert config.ffn_hidden_size == 256
    assert config.kv_channels == 16
    assert config.activation_func is F.gelu
    assert (config.hidden_dropout, config.attention_dropout, config.init_method_std) == (0.1, 0.1, 0.02)
    assert config.normalization == "LayerNorm" and config.layernorm_epsilon == 1e-5
    swiglu = TransformerConfig(**BASE, gated_linear_unit=True, ffn_hidden_size=96)
    assert swiglu.ffn_hidden_size == 96 and swiglu.activation_func is F.silu
    assert TransformerConfig(**BASE, gated_linear_unit=True).ffn_hidden_size == 256
    assert config.num_query_groups == 4  # multi-head attention: a key/value head per query head
    assert not config.qk_layernorm and not config.layernorm_zero_centered_gamma


def test_config_is_frozen_and_replace_revalidates():
    config = TransformerConfig(**BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 128
    # Derived fields hold values after construction: reset them to None to have them derived again.
    with pytest.raises(ValueError, match="--num-attention-heads"):
        dataclasses.replace(config, num_attention_heads=5, kv_channels=None)
    wider = dataclasses.replace(config, hidden_size=128, ffn_hidden_size=None, kv_channels=None)
    assert (wider.ffn_hidden_size, wider.kv_channels) == (512, 32)


def test_init_methods_have_the_documented_std():
    config = TransformerConfig(**BASE, init_method_std=0.05)
    generator_state = torch.get_rng_state()
    torch.manual_seed(0)
    plain = config.init_method(torch.empty(400, 500))
    scaled = config.output_layer_init_method(torch.empty(400, 500))
    torch.set_rng_state(generator_state)
    assert abs(plain.mean().item()) < 1e-3
    assert plain.std().item() == pytest.approx(0.05, rel=0.01)
    assert scaled.std().item() == pytest.approx(0.05 / math.sqrt(2 * 8), rel=0.01)


def test_embedding_init_method_follows_its_std_or_the_ordinary_init():
    unset = TransformerConfig(**BASE)
    assert unset.embedding_init_method_std is None and unset.embedding_init_method is unset.init_method
    config = TransformerConfig(**BASE, embedding_init_method_std=1.0)
    assert config.embedding_init_method.std == 1.0 and config.init_method.std == 0.02
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="--embedding-init-method-std must be positive"):
            TransformerConfig(**BASE, embedding_init_method_std=bad)


@pytest.mark.parametrize(
    "overrides, flag",
    [
        (dict(hidden_size=66), "--hidden-size .* divisible by --num-attention-heads"),
        (dict(hidden_size=66, kv_channels=16, tensor_model_parallel_size=4), "--hidden-size .* --tensor-model-parallel-size"),
        (dict(hidden_size=64, num_attention_heads=2, tensor_model_parallel_size=4), "--num-attention-heads .* --tensor-model-parallel-size"),
        (dict(ffn_hidden_size=90, tensor_model_parallel_size=4), "--ffn-hidden-size .* --tensor-model-parallel-size"),
        (dict(num_layers=6, pipeline_model_parallel_size=4), "--num-layers .* --pipeline-model-parallel-size"),
        (dict(num_layers=0), "--num-layers"),
        (dict(kv_channels=0), r"--kv-channels \(kv_channels\) must be positive, got 0"),
        (dict(normalization="BatchNorm"), "--normalization"),
        (dict(hidden_dropout=1.0), "--hidden-dropout"),
        (dict(attention_dropout=-0.1), "--attention-dropout"),
        (dict(init_method_std=0.0), "--init-method-std"),
        (dict(recompute_method="uniform", recompute_num_layers=1), "--recompute-method uniform needs --recompute-granularity full"),
        (dict(recompute_granularity="selective", recompute_method="block"), "needs --recompute-granularity full"),
        (dict(recompute_granularity="full", recompute_num_layers=1), "--recompute-granularity full needs --recompute-method"),
        (dict(recompute_granularity="full", recompute_method="uniform"), "--recompute-num-layers >= 1"),
        (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=9), "--recompute-num-layers .* block"),
        (dict(recompute_granularity="selective", recompute_num_layers=2), "--recompute-num-layers only applies"),
        (dict(recompute_granularity="everything"), "--recompute-granularity"),
        (dict(sequence_parallel=True), "--sequence-parallel"),
        (dict(num_query_groups=3), r"--num-query-groups \(3\) must be a positive divisor of --num-attention-heads"),
        (dict(num_query_groups=0), "--num-query-groups"),
        (dict(num_query_groups=2, tensor_model_parallel_size=4), r"--num-query-groups \(2\) must be divisible by --tensor-model-parallel-size \(4\)"),
    ],
)
def test_invalid_combinations_name_the_flag(overrides, flag):
    with pytest.raises(ValueError, match=flag):
        TransformerConfig(**{**BASE, **overrides})


def test_moe_layer_recompute_is_refused_with_full_recompute_as_on_the_command_line():
    """As upstream (and --moe-layer-recompute with --recompute-granularity full on the command line): full recompute
    already recomputes whole layers, their MoE part included."""
    with pytest.raises(ValueError, match=r"^--moe-layer-recompute does not work with --recompute-granularity full "
                                         r"\(full recompute already recomputes the whole layer, its MoE part "
                                         r"included\): drop one of them$"):
        TransformerConfig(**BASE, num_moe_experts=2, moe_layer_recompute=True, recompute_granularity="full",
                          recompute_method="uniform", recompute_num_layers=1)
    selective = TransformerConfig(**BASE, num_moe_experts=2, moe_layer_recompute=True,
                                  recompute_granularity="selective")
    assert selective.moe_layer_recompute and selective.recompute_modules == ("core_attn",)


def test_kv_channels_given_explicitly_lifts_the_head_divisibility_rule():
    config = TransformerConfig(num_layers=2, hidden_size=66, num_attention_heads=4, kv_channels=16)
    assert config.kv_channels == 16


def test_valid_recompute_settings():
    full = TransformerConfig(**BASE, recompute_granularity="full", recompute_method="block", recompute_num_layers=8)
    assert full.recompute_num_layers == 8
    assert TransformerConfig(**BASE, recompute_granularity="selective").recompute_method is None


def test_training_loop_hooks_can_be_assigned_in_place():
    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2)

    def finalize(model_chunks, num_tokens=None):
        return None

    config.finalize_model_grads_func = finalize  # as upstream's own training loops do
    config.no_sync_func = [lambda: None, lambda: None]
    config.grad_sync_func = config.param_sync_func = config.grad_scale_func = config.timers = None
    assert config.finalize_model_grads_func is finalize and len(config.no_sync_func) == 2
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"dataclasses.replace\(config, hidden_size=\.\.\.\)"):
        config.hidden_size = 16
    assert config.hidden_size == 8


MLA_SHAPE = dict(q_lora_rank=8, kv_lora_rank=12, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=10)


def test_mla_transformer_config_has_upstreams_defaults():
    config = MLATransformerConfig(**BASE)
    assert config.multi_latent_attention and isinstance(config, TransformerConfig)
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim,
            config.v_head_dim) == (512, 512, 128, 64, 128)
    assert (config.normalization, config.rope_type, config.rotary_base, config.rotary_scaling_factor) == \
        ("RMSNorm", "yarn", 10000.0, 40.0)
    assert (config.original_max_position_embeddings, config.beta_fast, config.beta_slow, config.mscale,
            config.mscale_all_dim) == (4096, 32.0, 1.0, 1.0, 0.0)
    for overrides, message in ((dict(multi_latent_attention=False), "keep multi_latent_attention=True"),
                               (dict(rotary_percent=0.5), "rotary_percent"),
                               (dict(cache_mla_latents=True), "cache_mla_latents"),
                               (dict(num_query_groups=2), "--num-query-groups")):
        with pytest.raises(ValueError, match=message):
            MLATransformerConfig(**BASE, **overrides)



def test_mla_transformer_config_with_plain_rope_leaves_its_yarn_default_unused():
    """As upstream, MLATransformerConfig(rope_type="rope") keeps the class's YaRN factor of 40, unused: the rope
    channels rotate with plain RoPE and neither cos / sin nor the softmax scale carry a YaRN factor. A factor set
    to another value is still refused (it would change nothing)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.multi_latent_attention import build_mla_rotary_embedding, mla_softmax_scale

    config = MLATransformerConfig(**BASE, rope_type="rope")
    assert (config.effective_rope_type, config.rotary_scaling_factor) == ("rope", 40.0)
    rotary, cos_sin_scale = build_mla_rotary_embedding(config)
    assert type(rotary) is RotaryEmbedding and cos_sin_scale == 1.0
    assert mla_softmax_scale(config) == pytest.approx(1 / math.sqrt(128 + 64), rel=1e-15)
    assert MLATransformerConfig(**BASE, rope_type="rope", rotary_scaling_factor=1.0).rotary_scaling_factor == 1.0
    with pytest.raises(ValueError, match="--rotary-scaling-factor 2.0 scales YaRN rotary embeddings"):
        MLATransformerConfig(**BASE, rope_type="rope", rotary_scaling_factor=2.0)

def test_gpt_model_built_from_mla_transformer_config_equals_the_transformer_config_one():
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from tests.unit_tests.models.gpt.gpt_test_utils import fixed_batch, seeded_model

    common = dict(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                  **MLA_SHAPE)
    mla = MLATransformerConfig(**common, rotary_scaling_factor=4.0, original_max_position_embeddings=8)
    plain = TransformerConfig(**common, multi_latent_attention=True, normalization="RMSNorm",
                              rotary_scaling_factor=4.0, original_max_position_embeddings=8)
    tokens, labels, position_ids = fixed_batch()
    model = seeded_model(mla, position_embedding_type="rope")
    reference = seeded_model(plain, position_embedding_type="rope")
    attention = model.decoder.layers[0].self_attention
    assert isinstance(attention, MLASelfAttention)
    assert (attention.linear_q_down_proj.weight.shape, attention.linear_kv_down_proj.weight.shape,
            attention.linear_kv_up_proj.weight.shape) == ((8, 32), (12 + 4, 32), (4 * (6 + 10), 12))
    assert [(name, tuple(p.shape)) for name, p in model.named_parameters()] == \
        [(name, tuple(p.shape)) for name, p in reference.named_parameters()]
    with torch.no_grad():
        loss = model(tokens, position_ids, labels=labels)
        assert torch.equal(loss, reference(tokens, position_ids, labels=labels))
    assert torch.isfinite(loss).all() and loss.shape == labels.shape

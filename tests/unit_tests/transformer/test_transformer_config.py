"""TransformerConfig: derived defaults, init methods' statistics, and errors that name the flag to change."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.transformer_config import TransformerConfig

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

"""Upstream's GPTModel(config, transformer_layer_spec, vocab_size, max_sequence_length) call: the layer specs are
checked against the config, and a config whose tensor-parallel size differs from the group's is refused."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.multiprocess_harness import run_on_ranks


def _config(**overrides):
    return TransformerConfig(num_layers=2, hidden_size=12, num_attention_heads=4, hidden_dropout=0.0,
                             attention_dropout=0.0, **overrides)


def test_local_spec_builds_the_same_model_as_no_spec():
    config = _config(init_seed=5)
    with_spec = GPTModel(config, get_gpt_layer_local_spec(), 32, 16)
    without = GPTModel(config, vocab_size=32, max_sequence_length=16)
    assert with_spec.state_dict().keys() == without.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(with_spec.state_dict().values(), without.state_dict().values()))


def test_specs_asking_for_other_layers_name_the_config_field():
    with pytest.raises(ValueError, match=r"TransformerConfig\(qk_layernorm=True\)"):
        GPTModel(_config(), get_gpt_layer_local_spec(qk_layernorm=True), 32, 16)
    with pytest.raises(ValueError, match=r"TransformerConfig\(transformer_impl='transformer_engine'\)"):
        GPTModel(_config(), get_gpt_layer_with_transformer_engine_spec(), 32, 16)
    with pytest.raises(ValueError, match=r"TransformerConfig\(normalization='RMSNorm'\)"):
        GPTModel(_config(), get_gpt_layer_local_spec(normalization="RMSNorm"), 32, 16)
    with pytest.raises(ValueError, match=r"asks for fp8='hybrid' but the TransformerConfig has fp8=None: .* set "
                                         r"TransformerConfig\(fp8='hybrid'\)"):
        GPTModel(_config(), get_gpt_layer_local_spec(fp8="hybrid"), 32, 16)
    with pytest.raises(TypeError, match="vocab_size, max_sequence_length"):
        GPTModel(_config(), 32, 16)  # this project's old positional order


def test_deprecated_fp8_argument_agreeing_with_the_config_builds():
    """Older upstream scripts pass args.fp8 to the spec (upstream ignores it with a deprecation warning); here it
    must agree with TransformerConfig(fp8=...), which is what builds the layers."""
    model = GPTModel(_config(fp8="hybrid"), get_gpt_layer_local_spec(None, False, False, False, "hybrid"), 32, 16)
    assert model.config.fp8 == "hybrid"
    spec = get_gpt_layer_with_transformer_engine_spec(fp8="e4m3", use_te_activation_func=True,
                                                      fallback_to_eager_attn=True)
    assert spec.config_fields["fp8"] == "e4m3" and spec.config_fields["transformer_impl"] == "transformer_engine"


def test_decoder_block_spec_of_a_moe_config_builds_the_model():
    """Upstream's pretrain_gpt.py builds MoE models with get_gpt_decoder_block_spec(config, use_transformer_engine,
    normalization=..., qk_l2_norm=..., vp_stage=...)."""
    config = _config(num_moe_experts=2, moe_router_topk=2, moe_layer_freq=[0, 1], normalization="RMSNorm",
                     init_seed=5)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                      qk_l2_norm=False, vp_stage=None)
    with_spec = GPTModel(config, spec, 32, 16)
    without = GPTModel(config, vocab_size=32, max_sequence_length=16)
    assert any(".mlp.router." in name for name in with_spec.state_dict())
    assert with_spec.state_dict().keys() == without.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(with_spec.state_dict().values(), without.state_dict().values()))
    with pytest.raises(ValueError, match=r"TransformerConfig\(transformer_impl='transformer_engine'\)"):
        GPTModel(config, get_gpt_decoder_block_spec(config, use_transformer_engine=True), 32, 16)


def _model_with_default_tensor_parallel_size():
    parallel_state.initialize_model_parallel(2, 1)
    try:
        GPTModel(_config(), get_gpt_layer_local_spec(), 32, 16)
    except ValueError as error:
        return str(error)
    finally:
        parallel_state.destroy_model_parallel()


def test_config_tensor_parallel_size_must_match_the_group():
    for message in run_on_ranks(2, _model_with_default_tensor_parallel_size):
        assert "TransformerConfig(tensor_model_parallel_size=1) differs" in message
        assert "tensor_model_parallel_size=2" in message


def test_transformer_engine_spec_without_transformer_engine_points_to_the_local_spec():
    from megatron.core import optional_deps

    with pytest.raises(ValueError) as refused:
        GPTModel(_config(), get_gpt_layer_with_transformer_engine_spec(), 32, 16)
    hint = "transformer-engine is not importable here (it needs CUDA), so on this machine use get_gpt_layer_local_spec"
    assert (hint in str(refused.value)) == (not optional_deps.HAVE_TE)
    # Other fields keep the plain message.
    with pytest.raises(ValueError) as refused:
        GPTModel(_config(), get_gpt_layer_local_spec(qk_layernorm=True), 32, 16)
    assert "transformer-engine" not in str(refused.value)

"""megatron.core.post_training.modelopt.gpt.model_specs: `get_gpt_modelopt_spec(config, ...)` returns the spec of
the config's torch-native layers, from which GPTModel builds the same model as without a spec (upstream's
ModelOpt model builder); a given attention mask is applied as is (the arbitrary mask type); options that have
no counterpart are refused by name; and the reasons the module gives for modelopt's EAGLE plugin hold."""

import dataclasses

import pytest
import torch

from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.post_training.modelopt.gpt.model_specs import get_gpt_modelopt_spec
from megatron.core.transformer.spec_utils import ModuleSpec, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

VOCAB, SEQ = 64, 8


def _config(**overrides):
    fields = dict(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, hidden_dropout=0.0,
                  attention_dropout=0.0, normalization="RMSNorm", gated_linear_unit=True, init_seed=7,
                  use_cpu_initialization=True)
    fields.update(overrides)
    return TransformerConfig(**fields)


def _gpt(config, spec=None):
    Utils.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    return GPTModel(config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ).eval()


def test_modelopt_spec_builds_the_configs_model():
    config = _config(qk_layernorm=True)
    spec = get_gpt_modelopt_spec(config, remap_te_layernorm=True, use_arbitrary_attention_mask=True)
    assert isinstance(spec, ModuleSpec) and spec.config_fields["transformer_impl"] == "local"
    model, reference = _gpt(config, spec), _gpt(config)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ).unsqueeze(0).expand(2, -1)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(2, 1, SEQ, SEQ)  # True where masked
    first_two_only = causal.clone()
    first_two_only[..., 2:] = True
    first_two_only[..., :2, :2] = causal[..., :2, :2]
    with torch.no_grad():
        logits = model(tokens, positions)
        assert torch.equal(logits, reference(tokens, positions))
        assert model.state_dict().keys() == reference.state_dict().keys()
        torch.testing.assert_close(model(tokens, positions, attention_mask=causal), logits, rtol=1e-6, atol=1e-6)
        # An arbitrary mask is applied as given: no token sees past position 1, so later tokens change.
        masked = model(tokens, positions, attention_mask=first_two_only)
    torch.testing.assert_close(masked[:, :2], logits[:, :2], rtol=1e-6, atol=1e-6)
    assert (masked[:, 2:] - logits[:, 2:]).abs().max() > 1e-3


def test_mixed_moe_and_dense_layers_give_one_spec_per_layer():
    Utils.initialize_model_parallel()
    config = _config(num_moe_experts=2, moe_layer_freq=[1, 0], moe_router_topk=2)
    spec = get_gpt_modelopt_spec(config)
    assert isinstance(spec, TransformerBlockSubmodules)
    assert [layer.config_fields.get("num_moe_experts") for layer in spec.layer_specs] == [2, None]
    assert get_gpt_modelopt_spec(_config(num_moe_experts=2, moe_router_topk=2)).config_fields["num_moe_experts"] == 2


@pytest.mark.parametrize("config,kwargs,error,message", [
    (None, {}, TypeError, "needs the model's TransformerConfig"),
    (_config(), {"real_quant_cfg": "fp8_real_quant"}, ValueError, "real_quant_cfg='fp8_real_quant'"),
    (dataclasses.replace(_config(), transformer_impl="transformer_engine"), {}, ValueError,
     "--transformer-impl local"),
])
def test_options_without_a_counterpart_are_refused_by_name(config, kwargs, error, message):
    with pytest.raises(error, match=message):
        get_gpt_modelopt_spec(config, **kwargs)


def test_the_reasons_given_for_eagle_hold():
    fields = {field.name for field in dataclasses.fields(TransformerConfig)}
    assert TransformerConfig.__dataclass_params__.frozen
    assert "transformer_layer_spec" not in fields and "seq_length" not in fields
    with pytest.raises(AttributeError, match="dataclasses.replace"):  # EAGLE's conversion assigns fields after building
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2).hidden_size = 16

"""`SharedExpertMLP` built as upstream builds it, `(config, submodules, gate)`: the same weights as the MoE layer's
shared experts, the gate as asked (or as the config says), and bad arguments refused by name."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.transformer_config import TransformerConfig

HIDDEN, SEED = 8, 13


def config(**overrides):
    fields = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                  moe_ffn_hidden_size=8, moe_shared_expert_intermediate_size=12, init_seed=SEED)
    fields.update(overrides)
    return TransformerConfig(**fields)


def _hand_built(shared, x):
    """fc2(act(fc1(x))), times sigmoid(x . w) when gated, with the module's own weights."""
    hidden = F.linear(x, shared.linear_fc1.weight, shared.linear_fc1.bias)
    output = F.linear(shared.config.activation_func(hidden), shared.linear_fc2.weight, shared.linear_fc2.bias)
    return output if shared.gate_weight is None else output * torch.sigmoid(F.linear(x, shared.gate_weight))


def test_upstream_constructor_builds_the_moe_layers_shared_experts():
    gated = config(moe_shared_expert_gate=True)
    shared = SharedExpertMLP(gated, None, True)
    layer = MoELayer(gated)
    assert shared.state_dict().keys() == layer.shared_experts.state_dict().keys()
    for name, value in shared.state_dict().items():
        assert torch.equal(value, layer.shared_experts.state_dict()[name]), name
    x = torch.randn(3, 2, HIDDEN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(shared(x), _hand_built(shared, x), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(shared(x), layer.shared_experts(x), rtol=0, atol=0)


def test_gate_argument_overrides_the_config():
    assert SharedExpertMLP(config(), None, gate=True).gate_weight.shape == (1, HIDDEN)
    assert SharedExpertMLP(config(moe_shared_expert_gate=True), None, gate=False).gate_weight is None
    assert SharedExpertMLP(config(moe_shared_expert_gate=True)).gate_weight is not None  # None: as the config


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(TypeError, match="layer_init_seed"):
        SharedExpertMLP(config(), SEED)
    with pytest.raises(ValueError, match="pg_collection"):
        SharedExpertMLP(config(), None, False, pg_collection=object())
    with pytest.raises(ValueError, match="--moe-shared-expert-intermediate-size"):
        SharedExpertMLP(config(moe_shared_expert_intermediate_size=None))

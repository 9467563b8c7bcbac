"""MLP takes upstream's (config, submodules, is_expert, input_size, ffn_hidden_size, tp_group) and returns
`(output, output_bias)`."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig


def _config(**overrides):
    fields = dict(num_layers=1, hidden_size=16, num_attention_heads=4, init_seed=7)
    return TransformerConfig(**{**fields, **overrides})


def test_upstream_arguments_and_return():
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    config = _config()
    plain = MLP(config)
    with_submodules = MLP(config, ModuleSpec(module=MLP), False)  # accepted, not read: the same weights
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), with_submodules.state_dict().values()))
    narrow = MLP(config, None, False, input_size=8, ffn_hidden_size=12)
    assert narrow.linear_fc1.weight.shape == (12, 8) and narrow.linear_fc2.weight.shape == (16, 12)
    with torch.no_grad():
        narrow.linear_fc2.bias.normal_(generator=torch.Generator().manual_seed(0))  # visible (zero-initialised)
        x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(1))
        output, bias = narrow(x)
        fc1, fc2 = narrow.linear_fc1, narrow.linear_fc2
        expected = F.linear(F.gelu(F.linear(x, fc1.weight, fc1.bias)), fc2.weight)
    assert bias is fc2.bias  # returned for the layer to add, as upstream
    torch.testing.assert_close(output, expected)
    output, bias = MLP(_config(add_bias_linear=False))(torch.zeros(3, 2, 16))
    assert bias is None and output.shape == (3, 2, 16)


def test_arguments_it_cannot_honour_are_refused_by_name():
    with pytest.raises(TypeError, match=r"MLP\(config, 5\): the second argument is upstream's submodules; pass the "
                                        r"seed by keyword \(init_seed=5\)"):
        MLP(_config(), 5)
    with pytest.raises(ValueError, match=r"MLP\(tp_group=...\) is not supported: .* pass tp_group=None"):
        MLP(_config(), tp_group=object())

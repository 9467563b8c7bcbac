"""TransformerLayer takes upstream's (config, submodules, layer_number, hidden_dropout, ...) arguments."""

import pytest
import torch

from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_layer import TransformerLayer
from tests.unit_tests.models.gpt.gpt_test_utils import tiny_config


def _hidden():
    return torch.randn(4, 2, 32, generator=torch.Generator().manual_seed(3))


def test_upstream_positional_order_builds_the_same_layer():
    config = tiny_config(hidden_dropout=0.0)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    reference = TransformerLayer(config, layer_number=2).state_dict()
    spec = get_gpt_layer_local_spec()
    for layer in (TransformerLayer(config, spec.submodules, 2),
                  TransformerLayer(config, spec.submodules, 2, None, None, None)):
        assert layer.layer_number == 2
        state = layer.state_dict()
        assert state.keys() == reference.keys()
        assert all(torch.equal(state[name], reference[name]) for name in reference)


def test_hidden_dropout_argument_overrides_the_config():
    config = tiny_config(hidden_dropout=0.0)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    x = _hidden()
    kept = TransformerLayer(config, None, 1).train()
    assert kept.hidden_dropout.p == 0.0 and not torch.allclose(kept(x), x)
    dropped = TransformerLayer(config, None, 1, hidden_dropout=1.0).train()
    assert dropped.hidden_dropout.p == 1.0
    torch.testing.assert_close(dropped(x), x)  # both sublayer outputs dropped: the residual stream alone


def test_arguments_this_layer_cannot_honour_are_refused_by_name():
    config = tiny_config()
    with pytest.raises(TypeError, match=r"second argument is upstream's submodules; pass the layer number by "
                                        r"keyword \(layer_number=3\)"):
        TransformerLayer(config, 3)
    with pytest.raises(TypeError, match=r"TransformerLayer\(submodules=ModuleSpec\(.*pass spec.submodules \(None\)"):
        TransformerLayer(config, get_gpt_layer_local_spec())
    with pytest.raises(ValueError, match=r"TransformerLayer\(pg_collection=...\) is not supported here"):
        TransformerLayer(config, None, 1, pg_collection=object())
    with pytest.raises(ValueError, match=r"TransformerLayer\(vp_stage=...\) is not supported here"):
        TransformerLayer(config, None, 1, vp_stage=0)

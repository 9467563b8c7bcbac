"""GPTModel.sharded_state_dict / load_state_dict as upstream's own training loops use them with
dist_checkpointing: keys are the logical names (global layer index), and the dict `dist_checkpointing.load`
returns loads back with `model.load_state_dict`."""

import torch

from megatron.core import dist_checkpointing
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig


def _later_stage(seed):
    """A 2-layer stage standing for the second half of a 4-layer model (its first layer is global layer 2)."""
    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, init_seed=seed)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=16,
                     max_sequence_length=8, pre_process=True, post_process=True)
    model.decoder.layer_offset = 2
    return model


def test_later_stage_keys_name_global_layers_and_load_back(tmp_path):
    saved, target = _later_stage(1), _later_stage(2)
    keys = set(saved.sharded_state_dict())
    assert "decoder.layers.2.self_attention.linear_qkv.weight" in keys
    assert "decoder.layers.3.mlp.linear_fc2.weight" in keys
    assert not any(key.startswith(("decoder.layers.0.", "decoder.layers.1.")) for key in keys)
    assert set(saved.sharded_state_dict(prefix="m.")) == {f"m.{key}" for key in keys}

    dist_checkpointing.save(saved.sharded_state_dict(), tmp_path / "ckpt")
    before = {key: value.clone() for key, value in target.state_dict().items()}
    loaded = dist_checkpointing.load(target.sharded_state_dict(), tmp_path / "ckpt")
    target.load_state_dict(loaded)
    restored, expected = target.state_dict(), saved.state_dict()
    assert set(restored) == set(expected)
    assert all(torch.equal(restored[key], expected[key]) for key in expected)
    assert not torch.equal(before["decoder.layers.0.mlp.linear_fc1.weight"],
                           restored["decoder.layers.0.mlp.linear_fc1.weight"])
    target.load_state_dict(saved.state_dict())  # local names still load

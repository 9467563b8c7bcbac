"""Heterogeneous-layer flags: the config file read into the saved JSON text, the layers in the model's config,
what they do not combine with, and a checkpoint of other layers refused by the flag on load."""

import json
from types import SimpleNamespace

import pytest

from megatron.training.model_config import core_transformer_config_from_args
from tests.unit_tests.training.argument_checks import validated

BLOCK_CONFIGS = [{"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}},
                 {"attention": {"replace_with_linear": True}, "ffn": {"no_op": True}}]


def _config_file(tmp_path, block_configs=BLOCK_CONFIGS, **keys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "nemotron-nas", **keys, "block_configs": block_configs}))
    return path


def test_the_config_file_is_read_into_the_json_the_checkpoint_saves(tmp_path):
    path = _config_file(tmp_path, hidden_size=64)
    args = validated(f"--heterogeneous-layers-config-path {path}")
    assert args.heterogeneous_layers_config_encoded_json == path.read_text()
    config = core_transformer_config_from_args(args)
    assert config.get_config_for_layer(1).num_query_groups == 2
    assert config.get_config_for_layer(1).ffn_hidden_size == 256
    assert config.heterogeneous_block(2).attention.replace_with_linear and config.heterogeneous_block(2).mlp.no_op


def test_the_json_text_alone_builds_the_same_layers(tmp_path):
    text = json.dumps({"block_configs": BLOCK_CONFIGS}).replace(" ", "")
    config = core_transformer_config_from_args(validated(f"--heterogeneous-layers-config-encoded-json {text}"))
    from_file = core_transformer_config_from_args(
        validated(f"--heterogeneous-layers-config-path {_config_file(tmp_path)}"))
    assert config.heterogeneous_block_configs == from_file.heterogeneous_block_configs


@pytest.mark.parametrize("extra, message", [
    ("--num-experts 4", "--num-experts does not combine with heterogeneous layers"),
    ("--tensor-model-parallel-size 2 --num-layers 2",
     r"block_configs\[0\]: 1 query groups do not split over --tensor-model-parallel-size 2"),
    ("--num-layers 3", "2 block_configs for --num-layers 3"),
    ("--hidden-size 128", "has hidden_size 64 but --hidden-size is 128"),
])
def test_layers_the_flags_contradict_stop_at_validation(tmp_path, extra, message):
    blocks = BLOCK_CONFIGS if "tensor" not in extra else [
        {"attention": {"n_heads_in_group": 4}, "ffn": {"ffn_mult": 2.0}}] * 2
    path = _config_file(tmp_path, blocks, hidden_size=64)
    with pytest.raises(ValueError, match=message):
        validated(f"--heterogeneous-layers-config-path {path} {extra}", world_size=2)


def test_a_missing_config_file_is_named():
    with pytest.raises(ValueError, match="--heterogeneous-layers-config-path /no/such.json: no such file"):
        validated("--heterogeneous-layers-config-path /no/such.json")


def test_a_checkpoint_of_other_layers_is_refused_naming_the_flag():
    from megatron.core.dist_checkpointing.serialization import CheckpointError
    from megatron.training.checkpoint_args import check_same_architecture

    def args(blocks):
        text = None if blocks is None else json.dumps({"block_configs": blocks})
        return SimpleNamespace(hidden_size=64, num_attention_heads=4, heterogeneous_layers_config_encoded_json=text)

    other = [BLOCK_CONFIGS[0], {"attention": {"no_op": True}, "ffn": {"ffn_mult": 7.0}}]
    check_same_architecture("ckpt", args(BLOCK_CONFIGS), args(json.loads(json.dumps(BLOCK_CONFIGS))))
    with pytest.raises(CheckpointError, match=r"--heterogeneous-layers-config-path: 2/256 linear/none in the "
                                              r"checkpoint, 2/256 none/512 in this run"):
        check_same_architecture("ckpt", args(BLOCK_CONFIGS), args(other))
    with pytest.raises(CheckpointError, match=r"2/256 linear/none in the checkpoint, none in this run.*"
                                              r"--heterogeneous-layers-config-path of its layers"):
        check_same_architecture("ckpt", args(BLOCK_CONFIGS), args(None))


def test_the_flop_estimate_counts_each_layer_as_built(tmp_path):
    from megatron.training.training_log import training_flops_per_iteration

    args = validated(f"--heterogeneous-layers-config-path {_config_file(tmp_path)}")
    args.padded_vocab_size = 128
    hidden, seq = 64, 32
    # Layer 1: Q and output projections 64 -> 64, K and V for 2 heads of 16, causal attention over 32 positions,
    # a plain MLP (gelu: fc1 and fc2) of width 256. Layer 2: a 64 x 64 linear, no MLP.
    layer_1 = 2 * hidden * (64 + 2 * 32) + 2 * 64 * hidden + 2 * seq * 64 + 2 * 2 * hidden * 256
    layer_2 = 2 * hidden * hidden
    per_token = layer_1 + layer_2 + 2 * hidden * 128
    assert training_flops_per_iteration(args, global_batch_size=8) == 3 * per_token * seq * 8

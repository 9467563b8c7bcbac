"""Reading a Llama-Nemotron `block_configs` list: widths from ffn_mult, query groups from n_heads_in_group, and
the entries refused by layer and key."""

import json

import pytest

from megatron.core.transformer.heterogeneous.block_configs import (
    AttentionBlockConfig,
    LayerBlockConfig,
    MLPBlockConfig,
    ffn_mult_to_intermediate_size,
    parse_block_configs,
)
from megatron.core.transformer.transformer_config import TransformerConfig


def _entry(attention=None, ffn=None):
    return {"attention": {"n_heads_in_group": 8, "no_op": False, "replace_with_linear": False, **(attention or {})},
            "ffn": {"ffn_mult": 2.625, "no_op": False, "replace_with_linear": False, **(ffn or {})}}


@pytest.mark.parametrize("ffn_mult, hidden, width", [
    (5.25, 8192, 28672),  # Llama 3 70B's MLP: 2/3 x 5.25 x 8192 exactly
    (2.625, 8192, 14336),
    (1.3125, 8192, 7168),
    (1.0, 8192, 5632),  # 5461 rounded up to a multiple of 256
    (2.0, 64, 256),  # 85 -> 256
])
def test_ffn_mult_gives_the_width_rounded_up_to_a_multiple_of_256(ffn_mult, hidden, width):
    assert ffn_mult_to_intermediate_size(ffn_mult, hidden) == width


def test_each_entry_becomes_its_layer_shape():
    entries = [
        _entry(),
        _entry({"n_heads_in_group": None, "no_op": True}, {"ffn_mult": None, "replace_with_linear": True}),
        _entry({"n_heads_in_group": None, "replace_with_linear": True, "window_length": None},
               {"ffn_mult": None, "no_op": True, "sparsify": None}),
    ]
    layers = parse_block_configs(entries, hidden_size=8192, num_attention_heads=64, source="test")
    assert layers == (
        LayerBlockConfig(AttentionBlockConfig(num_query_groups=8), MLPBlockConfig(ffn_hidden_size=14336)),
        LayerBlockConfig(AttentionBlockConfig(no_op=True), MLPBlockConfig(replace_with_linear=True)),
        LayerBlockConfig(AttentionBlockConfig(replace_with_linear=True), MLPBlockConfig(no_op=True)),
    )
    assert [layer.attention.is_attention for layer in layers] == [True, False, False]
    assert [layer.mlp.is_mlp for layer in layers] == [True, False, False]


@pytest.mark.parametrize("entry, message", [
    (_entry({"window_length": 4096}), r"block_configs\[0\].attention.window_length = 4096: that variant"),
    (_entry({"n_heads_in_group": 3}), r"n_heads_in_group must be a positive divisor of --num-attention-heads \(64\)"),
    (_entry({"no_op": True, "replace_with_linear": True}), "sets both no_op and replace_with_linear"),
    (_entry(ffn={"ffn_mult": -1.0}), r"block_configs\[0\].ffn.ffn_mult must be a positive number"),
    (_entry(ffn={"moe": {"num_local_experts": 8}}), r"ffn.moe = .*that variant is not built here"),
    (_entry(ffn={"gate": True}), "ffn has keys this build does not know: gate"),
    ({"attention": {}}, "must be an object with exactly the keys attention and ffn"),
])
def test_entries_this_build_cannot_honour_are_refused_by_layer_and_key(entry, message):
    with pytest.raises(ValueError, match=message):
        parse_block_configs([entry], hidden_size=8192, num_attention_heads=64, source="test")


def _config(block_configs, **overrides):
    fields = dict(num_layers=len(block_configs), hidden_size=64, num_attention_heads=4, hidden_dropout=0.0,
                  attention_dropout=0.0)
    fields.update(overrides)
    return TransformerConfig(heterogeneous_layers_config_encoded_json=json.dumps({"block_configs": block_configs}),
                             **fields)


def test_the_config_gives_each_layer_its_query_groups_and_width():
    config = _config([_entry({"n_heads_in_group": 2}, {"ffn_mult": 2.0}),
                      _entry({"n_heads_in_group": None, "no_op": True}, {"ffn_mult": 7.0})])
    first, second = config.get_config_for_layer(1), config.get_config_for_layer(2)
    assert (first.num_query_groups, first.ffn_hidden_size) == (2, 256)
    assert (second.num_query_groups, second.ffn_hidden_size) == (4, 512)  # no attention: the model's groups
    assert not first.is_heterogeneous and config.is_heterogeneous
    assert config.heterogeneous_block(2).attention.no_op


def test_the_config_file_is_read_into_the_json_text(tmp_path):
    path = tmp_path / "config.json"
    text = json.dumps({"hidden_size": 64, "block_configs": [_entry({"n_heads_in_group": 4})]})
    path.write_text(text)
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                               heterogeneous_layers_config_path=str(path))
    assert config.heterogeneous_layers_config_encoded_json == text
    assert config.get_config_for_layer(1).num_query_groups == 1


@pytest.mark.parametrize("overrides, block_configs, message", [
    ({"num_layers": 3}, [_entry({"n_heads_in_group": 2})] * 2, "2 block_configs for --num-layers 3"),
    ({"tensor_model_parallel_size": 2}, [_entry({"n_heads_in_group": 4})],
     r"block_configs\[0\]: 1 query groups do not split over --tensor-model-parallel-size 2"),
    ({"num_moe_experts": 4}, [_entry({"n_heads_in_group": 2})], "--num-experts does not combine"),
    ({"hybrid_layer_pattern": "*"}, [_entry({"n_heads_in_group": 2})], "--hybrid-override-pattern does not"),
    ({"mtp_num_layers": 1}, [_entry({"n_heads_in_group": 2})], "--mtp-num-layers does not combine"),
])
def test_the_config_refuses_what_the_layers_cannot_be(overrides, block_configs, message):
    with pytest.raises(ValueError, match=message):
        _config(block_configs, **overrides)


def test_a_json_stating_another_shape_than_the_flags_is_refused():
    text = json.dumps({"hidden_size": 128, "block_configs": [_entry({"n_heads_in_group": 2})]})
    with pytest.raises(ValueError, match="has hidden_size 128 but --hidden-size is 64"):
        TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                          heterogeneous_layers_config_encoded_json=text)


def test_a_missing_file_is_named():
    with pytest.raises(ValueError, match="--heterogeneous-layers-config-path /no/such.json: no such file"):
        TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                          heterogeneous_layers_config_path="/no/such.json")

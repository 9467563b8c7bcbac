"""The table from upstream's YAML field names to this build's flags: every destination it names is a flag's,
none of its keys hides a flag of the same name, and the fields several flags describe (activation, dtype)
translate as upstream's YAML path reads them."""

import pytest

from megatron.training.arguments import build_parser
from megatron.training.yaml_config_keys import (
    ACCEPTED_AS_IS,
    COMBINED_FIELDS,
    NEGATED_FIELDS,
    RENAMED_FIELDS,
    SECTION_FIELDS,
    UnsupportedValue,
    settings_of_key,
)


def _destinations():
    return {action.dest for action in build_parser()._actions if action.option_strings}


def test_table_names_real_destinations_and_hides_none():
    destinations = _destinations()
    assert set(RENAMED_FIELDS.values()) <= destinations
    assert set(NEGATED_FIELDS.values()) <= destinations
    for key in (*RENAMED_FIELDS, *NEGATED_FIELDS, *COMBINED_FIELDS, *ACCEPTED_AS_IS):
        assert key not in destinations, key
    assert set(SECTION_FIELDS) <= destinations  # the flag alone at the top level

@pytest.mark.parametrize("section, expected", [
    ({"activation_func": "swiglu", "gated_linear_unit": False}, [("swiglu", True), ("squared_relu", False)]),
    ({"activation_func": "squaredrelu"}, [("swiglu", False), ("squared_relu", True)]),
    ({"activation_func": "gelu", "gated_linear_unit": False}, [("swiglu", False), ("squared_relu", False),
                                                               ("swiglu", False)]),
    ({"gated_linear_unit": True}, [("swiglu", True)]),
    ({"params_dtype": "torch.bfloat16"}, [("bf16", True), ("fp16", False)]),
    ({"params_dtype": "fp32"}, [("bf16", False), ("fp16", False)]),
    ({"init_method": "xavier_uniform"}, [("init_method_xavier_uniform", True)]),
    ({"layernorm_epsilon": 1e-6, "masked_softmax_fusion": False}, [("norm_epsilon", 1e-6),
                                                                   ("no_masked_softmax_fusion", True)]),
    ({"bias_swiglu_fusion": True, "enable_autocast": False}, [("no_bias_swiglu_fusion", False)]),
])
def test_fields_translate_to_destinations(section, expected):
    settings = [setting for key, value in section.items()
                for setting in settings_of_key(key, value, section, in_config_section=True)]
    assert settings == expected


def test_num_query_groups_turns_grouped_query_attention_on_in_a_config_section_only():
    assert settings_of_key("num_query_groups", 2, {}, in_config_section=True) == [
        ("group_query_attention", True), ("num_query_groups", 2)]
    assert settings_of_key("num_query_groups", 2, {}, in_config_section=False) is None


@pytest.mark.parametrize("key, value, section, message", [
    ("activation_func", "relu", {}, "'relu' is not one of swiglu, squaredrelu, gelu"),
    ("gated_linear_unit", True, {"activation_func": "gelu"}, "true with activation_func: gelu has no flag here"),
    ("params_dtype", "int8", {}, "'int8' is not one of bf16"),
    ("masked_softmax_fusion", "off", {}, "must be true or false, got 'off'"),
    ("enable_autocast", True, {}, "True is not supported: this build has no such setting and computes as with false"),
])
def test_values_no_flag_gives_are_refused(key, value, section, message):
    with pytest.raises(UnsupportedValue, match=message):
        settings_of_key(key, value, section, in_config_section=True)


def test_destinations_and_unknown_keys_are_left_to_the_caller():
    assert settings_of_key("num_layers", 4, {}, in_config_section=True) is None
    assert settings_of_key("no_such_field", 1, {}, in_config_section=False) is None

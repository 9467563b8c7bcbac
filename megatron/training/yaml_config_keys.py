"""How the keys of an upstream Megatron-LM YAML configuration (`--yaml-cfg`) reach this build's flags.

Upstream's file holds `TransformerConfig` / `ModelParallelConfig` field names in its `language_model:` and
`model_parallel:` sections and argparse destinations at the top level. Most field names are also destinations
here; this table covers the rest, read off `core_transformer_config_from_args` (megatron/training/model_config.py)
and the `transformer_config_kwargs` of the argument groups, which build the config from the flags:

- a renamed field (`layernorm_epsilon` is `--norm-epsilon`'s `norm_epsilon`),
- a field whose flag stores its opposite (`masked_softmax_fusion: false` is `--no-masked-softmax-fusion`),
- a field that several flags describe together (`activation_func` / `gated_linear_unit`, `params_dtype`,
  `init_method`),
- a key this build has no flag for, accepted at the values it computes with anyway,
- a field whose flag needs a switch too (`num_query_groups` is `--num-query-groups` with `--group-query-attention`:
  the config's value is the model's), in the config sections only (at the top level it is the flag alone).

`settings_of_key(key, value, section, in_config_section)` turns one key into (destination, value) settings.
"""

ANY_VALUE = "any value"  # a switch that cannot change what is computed (a kernel fusion, a memory hook, ...)

# Field -> the argparse destination of the flag that sets it.
RENAMED_FIELDS = {
    "layernorm_epsilon": "norm_epsilon",
    "layernorm_zero_centered_gamma": "apply_layernorm_1p",
    "num_moe_experts": "num_experts",
    "fp8": "fp8_format",
    "virtual_pipeline_model_parallel_size": "num_virtual_stages_per_pipeline_rank",
}

# Field -> the destination of the `--no-...` switch that holds its opposite.
NEGATED_FIELDS = {
    "masked_softmax_fusion": "no_masked_softmax_fusion",
    "bias_swiglu_fusion": "no_bias_swiglu_fusion",
    "bias_gelu_fusion": "no_bias_gelu_fusion",
    "bias_dropout_fusion": "no_bias_dropout_fusion",
    "apply_rope_fusion": "no_rope_fusion",
    "persist_layer_norm": "no_persist_layer_norm",
    "bert_binary_head": "bert_no_binary_head",
}

# Keys with no flag here, accepted at the values this build computes with anyway.
ACCEPTED_AS_IS = {
    # Kernel fusions and communication or memory switches: the same values with either setting.
    "bias_activation_fusion": ANY_VALUE,
    "memory_efficient_layer_norm": ANY_VALUE,
    "clone_scatter_output_in_embedding": ANY_VALUE,
    "batch_p2p_comm": ANY_VALUE,
    "batch_p2p_sync": ANY_VALUE,
    "deallocate_pipeline_outputs": ANY_VALUE,
    "scatter_gather_tensors_in_pipeline": ANY_VALUE,
    "tp_comm_atomic_ag": ANY_VALUE,  # tune --tp-comm-overlap, which is refused when on
    "tp_comm_atomic_rs": ANY_VALUE,
    # Settings of BERT, T5 and RETRO datasets, which GPT training does not read (upstream's neither).
    "retriever_seq_length": ANY_VALUE,
    "sample_rate": ANY_VALUE,
    "mask_prob": ANY_VALUE,
    "short_seq_prob": ANY_VALUE,
    "adlr_autoresume_interval": ANY_VALUE,  # read only with adlr_autoresume
    # What this build does: no autocast, no token dropping by that old name, activations (not weights) offloaded
    # by --cpu-offloading, the embedding on the first pipeline stage, no ADLR autoresume.
    "enable_autocast": (False,),
    "moe_token_dropping": (False,),
    "cpu_offloading_weights": (False,),
    "cpu_offloading_activations": (True,),
    "standalone_embedding_stage": (False,),
    "adlr_autoresume": (False,),
}

# activation_func (upstream's YAML names) -> the activation switches it sets.
ACTIVATION_SWITCHES = {
    "swiglu": {"swiglu": True, "squared_relu": False},
    "squaredrelu": {"swiglu": False, "squared_relu": True},
    "gelu": {"swiglu": False, "squared_relu": False},
}

# params_dtype spellings -> (bf16, fp16)
PARAMS_DTYPES = {
    "bf16": (True, False), "bfloat16": (True, False), "torch.bfloat16": (True, False),
    "fp16": (False, True), "float16": (False, True), "half": (False, True), "torch.float16": (False, True),
    "fp32": (False, False), "float32": (False, False), "float": (False, False), "torch.float32": (False, False),
}


class UnsupportedValue(ValueError):
    """A key this table knows, at a value no flag here gives (the message says what is possible)."""


def _activation_func(value, section):
    del section
    if value not in ACTIVATION_SWITCHES:
        raise UnsupportedValue(f"{value!r} is not one of {', '.join(ACTIVATION_SWITCHES)} (upstream's choices; other "
                               "activations have their own top-level keys: openai_gelu, quick_geglu)")
    return list(ACTIVATION_SWITCHES[value].items())


def _gated_linear_unit(value, section):
    """As upstream's YAML path: activation_func swiglu makes the MLP gated whatever gated_linear_unit says."""
    activation = section.get("activation_func")
    if not isinstance(value, bool):
        raise UnsupportedValue(f"must be true or false, got {value!r}")
    if activation == "swiglu":
        return []
    if not value:
        return [("swiglu", False)]
    if activation is None:
        return [("swiglu", True)]
    raise UnsupportedValue(f"true with activation_func: {activation} has no flag here (the gated activations are "
                           "activation_func: swiglu and the top-level quick_geglu: true)")


def _params_dtype(value, section):
    del section
    if str(value) not in PARAMS_DTYPES:
        raise UnsupportedValue(f"{value!r} is not one of {', '.join(PARAMS_DTYPES)} (or null: from fp16 / bf16)")
    bf16, fp16 = PARAMS_DTYPES[str(value)]
    return [("bf16", bf16), ("fp16", fp16)]


def _init_method(value, section):
    del section
    if value != "xavier_uniform":
        raise UnsupportedValue(f"{value!r} is not xavier_uniform, the one upstream's YAML names (null: normal with "
                               "init_method_std)")
    return [("init_method_xavier_uniform", True)]


# Fields several flags describe together: field -> function(value, section) -> [(destination, value)].
COMBINED_FIELDS = {
    "activation_func": _activation_func,
    "gated_linear_unit": _gated_linear_unit,
    "params_dtype": _params_dtype,
    "init_method": _init_method,
}

def _num_query_groups(value, section):
    del section
    return [("group_query_attention", True), ("num_query_groups", value)]


# Config fields named like a flag that gives them only together with another: field -> function as above.
SECTION_FIELDS = {
    "num_query_groups": _num_query_groups,
}

KNOWN_KEYS = (*RENAMED_FIELDS, *NEGATED_FIELDS, *ACCEPTED_AS_IS, *COMBINED_FIELDS)


def settings_of_key(key, value, section, in_config_section):
    """[(destination, value)] that `key: value` stands for (empty for an accepted no-op), or None when this table
    does not know `key` (then it is an argparse destination, or unknown). `section` is the mapping holding the key,
    `in_config_section` whether that is language_model: or model_parallel:. Raises UnsupportedValue for a value no
    flag here gives."""
    if in_config_section and key in SECTION_FIELDS:
        return SECTION_FIELDS[key](value, section)
    if key in RENAMED_FIELDS:
        return [(RENAMED_FIELDS[key], value)]
    if key in NEGATED_FIELDS:
        if not isinstance(value, bool):
            raise UnsupportedValue(f"must be true or false, got {value!r}")
        return [(NEGATED_FIELDS[key], not value)]
    if key in COMBINED_FIELDS:
        return COMBINED_FIELDS[key](value, section)
    if key in ACCEPTED_AS_IS:
        accepted = ACCEPTED_AS_IS[key]
        if accepted is not ANY_VALUE and value not in accepted:
            raise UnsupportedValue(f"{value!r} is not supported: this build has no such setting and computes as "
                                   f"with {' or '.join(str(each).lower() for each in accepted)}")
        return []
    return None

"""Heterogeneous layers, upstream's flags: each layer's attention and MLP from a Llama-Nemotron `block_configs`
JSON (see megatron/core/transformer/heterogeneous/).

`--heterogeneous-layers-config-path` is read here into `--heterogeneous-layers-config-encoded-json`, so a
checkpoint's saved arguments carry the layers themselves (the file need not exist where the checkpoint is loaded);
where both are set the JSON text is used. The layers are checked here against the shape and tensor-parallel flags
(each entry's query groups and width), and what they do not combine with is refused by flag.
"""

from megatron.core.transformer.heterogeneous.heterogeneous_fields import PATH_FLAG, read_config_file


def add_arguments(parser):
    group = parser.add_argument_group("heterogeneous layers")
    group.add_argument("--heterogeneous-layers-config-path", default=None,
                       help="A Hugging Face config.json with block_configs (Llama-Nemotron / DeciLM): each layer's "
                       "query groups (n_heads_in_group) and MLP width (ffn_mult), or its attention / MLP dropped "
                       "(no_op) or replaced by one linear (replace_with_linear).")
    group.add_argument("--heterogeneous-layers-config-encoded-json", default=None,
                       help="The same JSON as a string (used where both are given).")


def validate(args):
    if args.heterogeneous_layers_config_encoded_json is None and args.heterogeneous_layers_config_path is not None:
        args.heterogeneous_layers_config_encoded_json = read_config_file(args.heterogeneous_layers_config_path)
    if args.heterogeneous_layers_config_encoded_json is None:
        return
    for flag, given in (("--num-experts", bool(args.num_experts)),
                        ("--multi-latent-attention", args.multi_latent_attention),
                        ("--hybrid-override-pattern", getattr(args, "hybrid_layer_pattern", None) is not None),
                        ("--mtp-num-layers", bool(args.mtp_num_layers))):
        if given:
            raise ValueError(f"{flag} does not combine with heterogeneous layers ({PATH_FLAG}): their layers are "
                             f"dense standard-attention layers; drop {flag}")
    _check_layers(args)


def _check_layers(args):
    """The layers against the shape and tensor-parallel flags now, rather than when the model is built."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, kv_channels=args.kv_channels,
                      ffn_hidden_size=args.ffn_hidden_size, gated_linear_unit=bool(args.swiglu),
                      tensor_model_parallel_size=args.tensor_model_parallel_size,
                      **transformer_config_kwargs(args))


def transformer_config_kwargs(args):
    return dict(heterogeneous_layers_config_path=getattr(args, "heterogeneous_layers_config_path", None),
                heterogeneous_layers_config_encoded_json=getattr(args, "heterogeneous_layers_config_encoded_json",
                                                                 None))

"""Multi-latent attention flags (DeepSeek-V2/V3): `--multi-latent-attention`, the latent ranks, the head widths
and the YaRN rotary scaling, with upstream's names and defaults.

The shape flags have defaults, so they are only an error without `--multi-latent-attention` when they differ
from them (they would otherwise be ignored); YaRN's flags likewise need the YaRN rope (`--rope-type yarn`, the
default with multi-latent attention). Shape rules (positive sizes, an even rope width, no grouped-query
attention, local layers) are `TransformerConfig`'s.
"""

MLA_FLAG = "--multi-latent-attention"

# (dest, flag, type, default) of the flags that only mean something with --multi-latent-attention.
SHAPE_FLAGS = (
    ("q_lora_rank", "--q-lora-rank", int, None),
    ("kv_lora_rank", "--kv-lora-rank", int, 32),
    ("qk_head_dim", "--qk-head-dim", int, 128),
    ("qk_pos_emb_head_dim", "--qk-pos-emb-head-dim", int, 64),
    ("v_head_dim", "--v-head-dim", int, 128),
)
# (dest, flag, type, default) of YaRN's flags.
YARN_FLAGS = (
    ("rotary_scaling_factor", "--rotary-scaling-factor", float, 1.0),
    ("mscale", "--mscale", float, 1.0),
    ("mscale_all_dim", "--mscale-all-dim", float, 0.0),
    ("original_max_position_embeddings", "--original-max-position-embeddings", int, None),
)
_HELP = {
    "q_lora_rank": "Rank of the query latent; unset: queries are projected straight from the hidden state.",
    "kv_lora_rank": "Rank of the key/value latent.",
    "qk_head_dim": "Per-head query/key channels without position embedding.",
    "qk_pos_emb_head_dim": "Per-head query/key channels rotated by RoPE (the key's are shared by all heads).",
    "v_head_dim": "Per-head value channels.",
    "rotary_scaling_factor": "YaRN context scaling factor of the multi-latent attention's rotary embedding.",
    "mscale": "YaRN mscale: cos and sin are multiplied by ms(s, mscale) / ms(s, mscale-all-dim).",
    "mscale_all_dim": "YaRN mscale-all-dim: the softmax scale is multiplied by ms(s, mscale-all-dim)^2.",
    "original_max_position_embeddings": "YaRN: the context length the unscaled RoPE was trained for (default 4096).",
}


def add_arguments(parser):
    group = parser.add_argument_group("multi-latent attention")
    group.add_argument(MLA_FLAG, action="store_true",
                       help="Multi-latent attention (DeepSeek-V2/V3): keys and values from a shared low-rank latent.")
    for dest, flag, flag_type, default in (*SHAPE_FLAGS, *YARN_FLAGS):
        group.add_argument(flag, type=flag_type, default=default, help=_HELP[dest])
    group.add_argument("--rope-type", default=None, choices=["rope", "yarn"],
                       help="Rotary embedding of multi-latent attention: yarn (its default) or rope.")


def _listed(flags):
    return ", ".join(flags) + (" applies" if len(flags) == 1 else " apply")


def _changed(args, flags):
    return [flag for dest, flag, _, default in flags if getattr(args, dest) != default]


def validate(args):
    if not args.multi_latent_attention:
        changed = _changed(args, (*SHAPE_FLAGS, *YARN_FLAGS))
        if changed:
            raise ValueError(f"{_listed(changed)} only to multi-latent attention: add {MLA_FLAG} or drop it")
        if args.rope_type == "yarn":
            raise ValueError(f"--rope-type yarn is implemented for {MLA_FLAG} only: add it or use --rope-type rope")
        if args.rope_type == "rope" and args.position_embedding_type != "rope":
            raise ValueError(f"--rope-type rope needs --position-embedding-type rope (or {MLA_FLAG}); drop it")
        return
    if args.rope_type == "rope":
        changed = _changed(args, YARN_FLAGS)
        if changed:
            raise ValueError(f"{_listed(changed)} only to the YaRN rotary embedding: use --rope-type yarn (the "
                             f"default with {MLA_FLAG}) or drop it")
    if args.rotary_percent != 1.0:
        raise ValueError(f"{MLA_FLAG} rotates all --qk-pos-emb-head-dim channels: drop --rotary-percent "
                         f"{args.rotary_percent} and size the rotated part with --qk-pos-emb-head-dim")


def transformer_config_kwargs(args):
    """The multi-latent attention fields of `TransformerConfig` the flags set (none without the flag)."""
    if not args.multi_latent_attention:
        return {}
    kwargs = {dest: getattr(args, dest) for dest, _, _, _ in (*SHAPE_FLAGS, *YARN_FLAGS)}
    if kwargs["original_max_position_embeddings"] is None:
        del kwargs["original_max_position_embeddings"]
    return dict(kwargs, multi_latent_attention=True, rope_type=args.rope_type, rotary_base=args.rotary_base)


def attention_flops_per_token(args):
    """Forward FLOPs of one token through one multi-latent attention layer, as upstream counts them (2 per
    multiply-add; the latent norms at 2 per latent channel): the projections, then the scores and the weighted
    sum over the `--seq-length` keys, halved by the causal mask."""
    hidden, heads, seq = args.hidden_size, args.num_attention_heads, args.seq_length
    query_width = heads * (args.qk_head_dim + args.qk_pos_emb_head_dim)
    if args.q_lora_rank is None:
        query = 2 * hidden * query_width
    else:
        query = 2 * args.q_lora_rank * (hidden + query_width + 1)
    key_value = (2 * hidden * (args.kv_lora_rank + args.qk_pos_emb_head_dim)
                 + 2 * args.kv_lora_rank * (heads * (args.qk_head_dim + args.v_head_dim) + 1))
    attention = seq * query_width + seq * heads * args.v_head_dim
    return query + key_value + attention + 2 * heads * args.v_head_dim * hidden

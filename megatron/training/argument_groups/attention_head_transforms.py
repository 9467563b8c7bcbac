"""NoPE layers and the QK L2 norm (Llama 4) and the attention output gate (Qwen3-Next), with upstream Megatron-LM's
flags and defaults; see megatron/core/transformer/attention_head_transforms.py for what they compute."""

import types

from megatron.core.transformer.attention_head_transforms import parse_no_rope_freq, validated_head_transforms


def add_arguments(parser):
    group = parser.add_argument_group("attention head transforms")
    group.add_argument("--no-rope-freq", default=None,
                       help="Layers that skip the rotary embedding (NoPE, Llama 4): an integer N makes every N-th "
                       "layer (1-based: N, 2N, ...) skip it, and must divide --num-layers; a list expression such as "
                       "\"([0]*3+[1]*1)*2\" gives one entry per layer, 1 for no rotary embedding. Needs "
                       "--position-embedding-type rope. Default: every layer rotates.")
    group.add_argument("--qk-l2-norm", action="store_true",
                       help="Llama 4's QK norm: divide each query and key head by its root mean square over the head "
                       "dim (eps --norm-epsilon, no learned weight).")
    group.add_argument("--attention-output-gate", action="store_true",
                       help="Qwen3-Next's gated attention: the QKV projection also produces one gate per query "
                       "channel and the attention output is multiplied by its sigmoid before the output projection.")


def validate(args):
    args.no_rope_freq = parse_no_rope_freq(args.no_rope_freq)
    if args.no_rope_freq is not None and getattr(args, "position_embedding_type", None) != "rope":
        raise ValueError(f"--no-rope-freq chooses which layers skip the rotary embedding: it needs "
                         f"--position-embedding-type rope (got {getattr(args, 'position_embedding_type', None)}); "
                         "add that or drop --no-rope-freq")
    # The config's rules, checked now so that a bad launch stops before anything is built.
    validated_head_transforms(types.SimpleNamespace(
        no_rope_freq=args.no_rope_freq, qk_l2_norm=args.qk_l2_norm, attention_output_gate=args.attention_output_gate,
        num_layers=args.num_layers, multi_latent_attention=getattr(args, "multi_latent_attention", False),
        qk_layernorm=getattr(args, "qk_layernorm", False)))


def transformer_config_kwargs(args):
    return dict(no_rope_freq=args.no_rope_freq, qk_l2_norm=args.qk_l2_norm,
                attention_output_gate=args.attention_output_gate)

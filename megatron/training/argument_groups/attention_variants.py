"""Sliding-window attention and attention sinks (gpt-oss), with upstream Megatron-LM's flags and defaults; see
megatron/core/transformer/attention_variants.py for what they compute."""

import types

from megatron.core.transformer.attention_variants import (
    SOFTMAX_TYPES,
    parse_window_attn_skip_freq,
    parse_window_size,
    validated_attention_variants,
)


def add_arguments(parser):
    group = parser.add_argument_group("attention variants")
    group.add_argument("--window-size", default=None,
                       help="Sliding-window attention \"(left, right)\", e.g. \"(128, 0)\": query i sees keys "
                       "i - left .. i + right, under the causal mask; -1 means no limit on that side. Default: full "
                       "causal attention.")
    group.add_argument("--window-attn-skip-freq", default=None,
                       help="With --window-size, the layers that use full attention instead: an integer N makes "
                       "every N-th layer (1-based) full attention; a list expression such as ([1]*3+[0]*1)*2 gives "
                       "one entry per layer, 1 for the window and 0 for full attention. Default: every layer uses "
                       "the window.")
    group.add_argument("--softmax-type", choices=SOFTMAX_TYPES, default="vanilla",
                       help="Attention sinks: off-by-one adds 1 to the softmax denominator, learnable adds exp of a "
                       "learned per-head logit (softmax_offset, zero-initialised, no weight decay).")


def validate(args):
    args.window_size = parse_window_size(args.window_size)
    args.window_attn_skip_freq = parse_window_attn_skip_freq(args.window_attn_skip_freq)
    # The config's rules, checked now so that a bad launch stops before anything is built.
    validated_attention_variants(types.SimpleNamespace(
        window_size=args.window_size, window_attn_skip_freq=args.window_attn_skip_freq,
        softmax_type=args.softmax_type, num_layers=args.num_layers,
        apply_query_key_layer_scaling=getattr(args, "apply_query_key_layer_scaling", False),
        fp16=getattr(args, "fp16", False)))


def transformer_config_kwargs(args):
    return dict(window_size=args.window_size, window_attn_skip_freq=args.window_attn_skip_freq,
                softmax_type=args.softmax_type)

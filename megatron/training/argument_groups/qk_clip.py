"""QK-Clip flags (upstream's names and defaults; see megatron/core/optimizer/qk_clip.py). QK-Clip pairs with Muon
(Kimi K2's MuonClip) but bounds the attention logits under any optimizer."""


def add_arguments(parser):
    group = parser.add_argument_group("qk clip")
    group.add_argument("--qk-clip", action="store_true",
                       help="After each optimizer step, scale down the query and key weights of every attention head "
                       "whose largest pre-softmax logit of the step exceeded --qk-clip-threshold.")
    group.add_argument("--qk-clip-alpha", type=float, default=0.5,
                       help="With gamma = threshold / max logit, queries are scaled by gamma^alpha and keys by "
                       "gamma^(1 - alpha); with --multi-latent-attention the query's rope part takes gamma and the "
                       "shared rope key is left alone.")
    group.add_argument("--qk-clip-threshold", type=float, default=100,
                       help="The bound QK-Clip keeps each head's largest attention logit under.")
    group.add_argument("--log-max-attention-logit", action="store_true",
                       help="Log the largest attention logit of the step (over all layers and heads).")


def validate(args):
    if args.qk_clip and args.optimizer_cpu_offload:
        raise ValueError("--qk-clip rescales the main weights on the device, but --optimizer-cpu-offload steps "
                         "them in host memory: drop one of the two flags")


def transformer_config_kwargs(args):
    """The QK-Clip fields of TransformerConfig (it checks their values and the attention they need)."""
    return dict(qk_clip=args.qk_clip, qk_clip_alpha=args.qk_clip_alpha, qk_clip_threshold=args.qk_clip_threshold,
                log_max_attention_logit=args.log_max_attention_logit)

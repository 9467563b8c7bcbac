"""`--recompute-activations`: upstream's shorthand for `--recompute-granularity selective` (recompute only the
core attention in backward). The granularity flags themselves live with the training flags (training.py); this
group runs before that one, so their rules see the granularity the shorthand chose. Also upstream's
`--distribute-saved-activations` (full recompute keeps 1/TP of each chunk's input per tensor-parallel rank) and
`--recompute-modules` (what selective recompute recomputes; its rules are `TransformerConfig`'s)."""


def add_arguments(parser):
    group = parser.add_argument_group("activation recompute shorthand")
    group.add_argument(
        "--recompute-activations",
        action="store_true",
        help="Same as --recompute-granularity selective: keep the layers' activations but recompute the core "
        "attention (its scores and softmax) in backward.",
    )
    group.add_argument(
        "--distribute-saved-activations",
        action="store_true",
        help="With --recompute-granularity full and TP > 1: keep only each tensor-parallel rank's 1/TP slice of a "
        "recomputed chunk's input between forward and backward; the recompute all-gathers it (not with "
        "--sequence-parallel, whose input is split already).",
    )
    group.add_argument(
        "--recompute-modules",
        nargs="*",
        default=None,
        help="With --recompute-granularity selective: the parts of each layer recomputed in backward instead of "
        "kept (default: core_attn). core_attn: attention scores and softmax; mlp: dense MLP layers; moe: whole MoE "
        "layers; shared_experts: the MoE shared experts; layernorm: both norms of a layer; moe_act: the routed "
        "experts' activation; mla_up_proj: multi-latent attention's up projections and RoPE. The last three also "
        "drop their outputs, which the next module would keep.",
    )


def validate(args):
    if args.distribute_saved_activations:
        # Upstream's rules.
        if args.recompute_granularity != "full":
            raise ValueError("--distribute-saved-activations splits the input full recompute keeps: it needs "
                             "--recompute-granularity full")
        if args.sequence_parallel:
            raise ValueError("--distribute-saved-activations does not work with --sequence-parallel (the "
                             "recomputed chunks' inputs are split across the tensor-parallel ranks already); drop "
                             "one of them")
        if args.tensor_model_parallel_size <= 1:
            raise ValueError("--distribute-saved-activations splits the recomputed chunks' inputs across the "
                             "tensor-parallel ranks: it needs --tensor-model-parallel-size > 1 (got "
                             f"{args.tensor_model_parallel_size}); drop it or raise the tensor-parallel size")
    if not args.recompute_activations:
        return
    if args.recompute_granularity == "full":
        # Upstream overwrites the explicit choice; here the two flags asking for different things is an error.
        raise ValueError("--recompute-activations means --recompute-granularity selective, which contradicts "
                         "--recompute-granularity full: drop one of them")
    args.recompute_granularity = "selective"

"""`--recompute-activations`: upstream's shorthand for `--recompute-granularity selective` (recompute only the
core attention in backward). The granularity flags themselves live with the training flags (training.py); this
group runs before that one, so their rules see the granularity the shorthand chose."""


def add_arguments(parser):
    group = parser.add_argument_group("activation recompute shorthand")
    group.add_argument(
        "--recompute-activations",
        action="store_true",
        help="Same as --recompute-granularity selective: keep the layers' activations but recompute the core "
        "attention (its scores and softmax) in backward.",
    )


def validate(args):
    if not args.recompute_activations:
        return
    if args.recompute_granularity == "full":
        # Upstream overwrites the explicit choice; here the two flags asking for different things is an error.
        raise ValueError("--recompute-activations means --recompute-granularity selective, which contradicts "
                         "--recompute-granularity full: drop one of them")
    args.recompute_granularity = "selective"

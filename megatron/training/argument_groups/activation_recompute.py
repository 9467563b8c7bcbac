"""`--recompute-activations`: upstream's shorthand for `--recompute-granularity selective` (recompute only the
core attention in backward). The granularity flags themselves live with the training flags (training.py); this
group runs before that one, so their rules see the granularity the shorthand chose. Also upstream's
`--distribute-saved-activations`, which this build does not implement: it stops here with what to use instead."""


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
        help="Upstream: with --recompute-granularity full and TP > 1, split each recomputed chunk's saved input "
        "across the tensor-parallel ranks. Not implemented here (use --sequence-parallel): an error.",
    )


def validate(args):
    if args.distribute_saved_activations:
        raise ValueError(
            "--distribute-saved-activations is not implemented: full recompute here keeps each checkpointed chunk's "
            "input whole on every tensor-parallel rank. Drop the flag; --sequence-parallel (with "
            "--tensor-model-parallel-size > 1) stores that input split across the tensor-parallel ranks, the same "
            "saving, under either --recompute-granularity")
    if not args.recompute_activations:
        return
    if args.recompute_granularity == "full":
        # Upstream overwrites the explicit choice; here the two flags asking for different things is an error.
        raise ValueError("--recompute-activations means --recompute-granularity selective, which contradicts "
                         "--recompute-granularity full: drop one of them")
    args.recompute_granularity = "selective"

"""Low-precision (FP8 / FP4) training flags."""


def add_arguments(parser):
    group = parser.add_argument_group("fp8")
    group.add_argument("--fp8-format", default=None, choices=["e4m3", "hybrid"], help="Enables FP8 training.")
    group.add_argument("--fp8-recipe", default="delayed", choices=["delayed", "tensorwise"])
    group.add_argument("--fp8-param-gather", action="store_true", help="Keep and gather parameters in FP8.")
    group.add_argument("--fp8-amax-history-len", type=int, default=1, help="Amax history (delayed scaling).")
    group.add_argument("--fp8-margin", type=int, default=0, help="Scaling-factor margin (delayed scaling).")
    group.add_argument("--fp4-format", default=None, choices=["e2m1"], help="Enables FP4 training.")
    group.add_argument("--fp4-recipe", default="nvfp4", choices=["nvfp4"])


def validate(args):
    if args.fp8_format is not None and args.fp4_format is not None:
        raise ValueError("--fp8-format and --fp4-format are exclusive: pick one")
    if args.fp8_param_gather and args.fp8_format is None:
        raise ValueError("--fp8-param-gather needs --fp8-format")
    if args.fp8_amax_history_len < 1:
        raise ValueError(f"--fp8-amax-history-len must be >= 1, got {args.fp8_amax_history_len}")

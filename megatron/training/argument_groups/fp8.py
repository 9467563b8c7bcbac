"""Low-precision (FP8 / FP4) training flags and the layer implementation (`--transformer-impl`)."""

import warnings

from megatron.core.fp8.formats import AMAX_COMPUTE_ALGOS, FP8_FORMATS, FP8_RECIPES, GPU_ONLY_RECIPES


def add_arguments(parser):
    group = parser.add_argument_group("fp8")
    group.add_argument(
        "--transformer-impl",
        default="local",
        choices=["local", "transformer_engine"],
        help="Layer implementation: torch-native (local) or Transformer Engine (GPU, needs transformer-engine).",
    )
    group.add_argument("--fp8-format", default=None, choices=list(FP8_FORMATS),
                       help="Enables FP8 training: e4m3, or hybrid (e4m3 forward, e5m2 gradients).")
    group.add_argument("--fp8-recipe", default="delayed", choices=list(FP8_RECIPES),
                       help="Scaling recipe; mxfp8 and blockwise need --transformer-impl transformer_engine on GPUs.")
    group.add_argument("--fp8-param-gather", action="store_true",
                       help="All-gather the FP8 layers' compute weights as FP8 bytes (distributed optimizer or "
                            "Megatron-FSDP optim_grads_params); Transformer Engine layers get them dequantized.")
    group.add_argument("--keep-fp8-transpose-cache", action="store_true",
                       help="Keep each FP8 weight's transpose (for the backward GEMM) from the pass that quantizes it, "
                            "cached for the optimizer step: one more byte per weight element, no transposed copy "
                            "per backward.")
    group.add_argument("--fp8-amax-history-len", type=int, default=1, help="Amax history (delayed scaling).")
    group.add_argument("--fp8-amax-compute-algo", default="most_recent", choices=list(AMAX_COMPUTE_ALGOS),
                       help="How the scale is read from the amax history (delayed scaling).")
    group.add_argument("--fp8-margin", type=int, default=0,
                       help="Delayed scaling: scales divided by 2**margin (current scaling takes none).")
    group.add_argument("--no-fp8-wgrad", action="store_false", dest="fp8_wgrad",
                       help="Compute the FP8 linear layers' weight gradients in higher precision (the activations' "
                       "dtype, from the unquantized input and output gradient); the forward and input-gradient GEMMs "
                       "stay FP8. The layer keeps its input in that dtype for backward instead of in FP8.")
    group.add_argument("--fp8-wgrad", action="store_true", dest="fp8_wgrad", default=True,
                       help="The default: weight gradients in FP8 too (undoes --no-fp8-wgrad).")
    group.add_argument("--fp8-interval", type=int, default=None,
                       help="DEPRECATED. This flag is ignored. Scaling update interval for fp8 (upstream's own "
                       "words; a warning says so).")
    group.add_argument("--tp-only-amax-red", action="store_true",
                       help="Delayed scaling: reduce the amaxes over the tensor-parallel group only (data-parallel "
                            "replicas keep their own histories).")
    group.add_argument("--fp8-dot-product-attention", action="store_true",
                       help="Not supported (refused): FP8 attention needs Transformer Engine's fused attention.")
    group.add_argument("--fp8-multi-head-attention", action="store_true",
                       help="Not supported (refused): FP8 attention needs Transformer Engine's fused attention.")
    group.add_argument("--first-last-layers-bf16", action="store_true",
                       help="Keep the first and last transformer layers out of FP8.")
    group.add_argument("--num-layers-at-start-in-bf16", type=int, default=1,
                       help="Layers at the start kept out of FP8 with --first-last-layers-bf16.")
    group.add_argument("--num-layers-at-end-in-bf16", type=int, default=1,
                       help="Layers at the end kept out of FP8 with --first-last-layers-bf16.")
    group.add_argument("--fp4-format", default=None, choices=["e2m1"], help="Enables FP4 training.")
    group.add_argument("--fp4-recipe", default="nvfp4", choices=["nvfp4"])


def validate(args):
    if args.fp8_format is not None and args.fp4_format is not None:
        raise ValueError("--fp8-format and --fp4-format are exclusive: pick one")
    if args.fp8_param_gather and args.fp8_format is None:
        raise ValueError("--fp8-param-gather needs --fp8-format")
    if args.keep_fp8_transpose_cache and args.fp8_format is None:
        warnings.warn("--keep-fp8-transpose-cache has no effect without --fp8-format (there are no FP8 weights to "
                      "cache); add --fp8-format to train in FP8, or drop the flag")
    if args.first_last_layers_bf16 and args.fp8_format is None:
        raise ValueError("--first-last-layers-bf16 needs --fp8-format")
    if args.fp8_interval is not None:
        warnings.warn(f"--fp8-interval {args.fp8_interval} is deprecated upstream and ignored (the scales are "
                      "updated every step under delayed scaling); drop it")
    if not args.fp8_wgrad and args.fp8_format is not None and args.transformer_impl == "transformer_engine" \
            and args.fp8_recipe != "delayed":
        raise ValueError(f"--no-fp8-wgrad with --transformer-impl transformer_engine needs --fp8-recipe delayed (the "
                         f"Transformer Engine recipe that takes a wgrad precision override), got --fp8-recipe "
                         f"{args.fp8_recipe}; use --transformer-impl local (delayed or tensorwise) or drop the flag")
    if args.fp8_format is not None and args.fp8_recipe != "delayed":
        delayed_flags = (("--fp8-amax-history-len", args.fp8_amax_history_len != 1),
                         ("--fp8-amax-compute-algo", args.fp8_amax_compute_algo != "most_recent"),
                         ("--fp8-margin", args.fp8_margin != 0))
        delayed_only = [flag for flag, set_ in delayed_flags if set_]
        if delayed_only:
            warnings.warn(f"{', '.join(delayed_only)}: flags of delayed scaling, without effect under --fp8-recipe "
                          f"{args.fp8_recipe} (as upstream); drop them or use --fp8-recipe delayed")
    if args.fp8_amax_history_len < 1:
        raise ValueError(f"--fp8-amax-history-len must be >= 1, got {args.fp8_amax_history_len}")
    if args.fp8_margin < 0:
        raise ValueError(f"--fp8-margin must be >= 0, got {args.fp8_margin}")
    if args.fp8_format is not None and args.fp8_recipe in GPU_ONLY_RECIPES and \
            args.transformer_impl != "transformer_engine":
        raise ValueError(
            f"--fp8-recipe {args.fp8_recipe} needs Transformer Engine on a GPU "
            "(--transformer-impl transformer_engine); "
            "the torch-native FP8 backend runs --fp8-recipe delayed or tensorwise"
        )
    if args.transformer_impl == "transformer_engine":
        from megatron.core.optional_deps import HAVE_TE

        if not HAVE_TE:
            raise ValueError(
                "--transformer-impl transformer_engine needs transformer-engine, which is not importable here "
                "(it needs CUDA): install it on a GPU machine (pip install '.[te]') or use --transformer-impl local"
            )
    if args.fp8_param_gather and getattr(args, "use_torch_fsdp2", False):
        raise ValueError("--fp8-param-gather is not supported with --use-torch-fsdp2 (FSDP2 gathers the weights in "
                         "their own dtype; the linear layers still run in FP8): drop --fp8-param-gather, or gather FP8 "
                         "weights with --use-megatron-fsdp or --use-distributed-optimizer instead")
    if args.fp8_param_gather and not (args.use_distributed_optimizer or getattr(args, "use_megatron_fsdp", False)):
        raise ValueError("--fp8-param-gather needs --use-distributed-optimizer (or --use-megatron-fsdp)")
    if args.fp8_param_gather and getattr(args, "use_megatron_fsdp", False):
        if args.data_parallel_sharding_strategy != "optim_grads_params":
            raise ValueError(
                "--fp8-param-gather with --use-megatron-fsdp needs --data-parallel-sharding-strategy "
                f"optim_grads_params (got {args.data_parallel_sharding_strategy}): only ZeRO-3 all-gathers the "
                "compute weights each step; drop --fp8-param-gather for the other strategies"
            )
        if args.outer_dp_sharding_strategy == "optim":
            raise ValueError("--fp8-param-gather with --use-megatron-fsdp does not support "
                             "--outer-dp-sharding-strategy optim (HFSDP); use no_shard (HSDP)")


def transformer_config_kwargs(args):
    """The FP8 / layer-implementation fields of `TransformerConfig` the flags set."""
    return {
        "transformer_impl": args.transformer_impl,
        "fp8": args.fp8_format,
        "fp8_recipe": args.fp8_recipe,
        "fp8_margin": args.fp8_margin,
        "fp8_amax_history_len": args.fp8_amax_history_len,
        "fp8_amax_compute_algo": args.fp8_amax_compute_algo,
        "fp8_param": args.fp8_param_gather,
        "keep_fp8_transpose_cache": args.keep_fp8_transpose_cache,
        "fp8_wgrad": args.fp8_wgrad,
        "tp_only_amax_red": args.tp_only_amax_red,
        "fp8_dot_product_attention": args.fp8_dot_product_attention,
        "fp8_multi_head_attention": args.fp8_multi_head_attention,
        "first_last_layers_bf16": args.first_last_layers_bf16,
        "num_layers_at_start_in_bf16": args.num_layers_at_start_in_bf16,
        "num_layers_at_end_in_bf16": args.num_layers_at_end_in_bf16,
    }

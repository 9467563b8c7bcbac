"""Mixture-of-Experts flags (`--num-experts`, `--moe-*`, `--expert-model-parallel-size`,
`--expert-tensor-parallel-size`), with upstream Megatron-LM's names and defaults.

The rules live in `MoEConfigMixin` (megatron/core/transformer/moe/moe_config.py); `validate` applies them at
argument time by building a transformer config of the fields they read, so a bad combination stops before any
process group starts.
The expert-parallel layout rule (DP x CP divisible by EP) is checked here because it needs the world size.
`--num-experts 0` means no MoE, as upstream; `--moe-router-padding-for-quantization` is upstream's newer
name of `--moe-router-padding-for-fp8`. Upstream's kernel-selection switches (--moe-permute-fusion,
--moe-router-fusion, --moe-use-legacy-grouped-gemm, --use-fused-weighted-squared-relu) are accepted and change
nothing: the torch ops run. DeepEP (--moe-enable-deepep) stops with what to do instead, and so does the removed
--moe-router-topk-limited-devices; the deprecated --moe-extended-tp is ignored with a warning, as upstream ignores
it. Latent MoE (--moe-latent-size) is a field of the config, validated there.
"""

import warnings

from megatron.core.transformer.moe.moe_config import (
    LOAD_BALANCING_TYPES,
    SCORE_FUNCTIONS,
    TOKEN_DISPATCHER_TYPES,
    TOKEN_DROP_POLICIES,
    _FIELDS_NEEDING_EXPERTS,
    normalize_load_balancing,
    parse_moe_layer_freq,
)

# Config field -> argparse destination, where they differ.
_ARG_NAMES = {"num_moe_experts": "num_experts"}


def add_arguments(parser):
    group = parser.add_argument_group("mixture of experts")
    group.add_argument("--num-experts", type=int, default=None,
                       help="Experts per MoE layer; unset or 0: no MoE.")
    group.add_argument("--expert-model-parallel-size", type=int, default=1,
                       help="Expert-parallel degree: each rank holds num_experts / this many experts.")
    group.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                       help="Tensor-parallel degree of the experts (default: the tensor-parallel size). The "
                       "expert ranks of a pipeline stage are laid out as expert-TP x EP x expert-DP.")
    group.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="Expert MLP width (default: ffn size).")
    group.add_argument("--moe-layer-freq", type=parse_moe_layer_freq, default=1,
                       help="An int N: layers 0, N, 2N, ... are MoE; or a list such as ([0]*3+[1]*5), one 0/1 per "
                       "layer.")
    group.add_argument("--moe-router-topk", type=int, default=2, help="Experts per token.")
    group.add_argument("--moe-router-score-function", choices=SCORE_FUNCTIONS, default="softmax")
    group.add_argument("--moe-router-pre-softmax", action="store_true",
                       help="Softmax over all experts before the top-k (no renormalisation); needed with "
                       "--moe-router-topk 1. No effect with sigmoid or sqrtsoftplus scores.")
    group.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                       help="Multiplies the routing probabilities.")
    group.add_argument("--moe-router-num-groups", type=int, default=None, help="Expert groups (group-limited routing).")
    group.add_argument("--moe-router-group-topk", type=int, default=None, help="Groups each token may use.")
    group.add_argument("--moe-router-enable-expert-bias", action="store_true",
                       help="Aux-loss-free balancing: per-expert bias for the choice, updated every step.")
    group.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    group.add_argument("--moe-router-bias", action="store_true",
                       help="A learned bias [num-experts] on the router's logits, x W^T + b (gpt-oss; zeros at "
                       "initialisation). Upstream adds it whenever linear layers have biases; here it is asked for, "
                       "so existing bias-linear MoE models and checkpoints are unchanged. Not the expert bias of "
                       "--moe-router-enable-expert-bias, which only steers the choice.")
    group.add_argument("--moe-router-dtype", choices=("fp32", "fp64"), default=None,
                       help="Router, probabilities and combine dtype (default: the input's).")
    group.add_argument("--moe-router-load-balancing-type", nargs="+", choices=LOAD_BALANCING_TYPES,
                       default="aux_loss", help="One type, or several auxiliary losses (aux_loss, seq_aux_loss, "
                       "global_aux_loss) each with its own --moe-aux-loss-coeff.")
    group.add_argument("--moe-aux-loss-coeff", nargs="+", type=float, default=0.0,
                       help="The coefficient of each --moe-router-load-balancing-type, in the same order.")
    group.add_argument("--moe-z-loss-coeff", type=float, default=None)
    group.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                       help="Tokens per expert capped at ceil(tokens * topk / experts * factor); unset: dropless.")
    group.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    group.add_argument("--moe-token-drop-policy", choices=TOKEN_DROP_POLICIES, default="probs")
    group.add_argument("--moe-token-dispatcher-type", choices=TOKEN_DISPATCHER_TYPES, default="allgather",
                       help="flex (DeepEP / HybridEP, CUDA only) is refused by this build.")
    group.add_argument("--moe-grouped-gemm", action="store_true",
                       help="One grouped GEMM over the local experts (torch's grouped_mm where supported).")
    group.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                       help="Total width of the shared experts (a dense MLP every token goes through).")
    group.add_argument("--moe-shared-expert-overlap", action="store_true",
                       help="Run the shared experts while tokens are exchanged (alltoall dispatcher).")
    group.add_argument("--moe-shared-expert-gate", action="store_true",
                       help="Multiply the shared experts' output by sigmoid(x . w), w a learned [1, hidden] weight.")
    group.add_argument("--moe-input-jitter-eps", type=float, default=None,
                       help="In training, multiply the router's input by uniform noise in [1 - eps, 1 + eps] (the "
                       "experts get the input unchanged).")
    group.add_argument("--moe-router-force-load-balancing", action="store_true",
                       help="Benchmarking: route by random normal logits, ignoring the router's scores (balanced "
                       "load whatever the weights).")
    group.add_argument("--moe-router-padding-for-fp8", "--moe-router-padding-for-quantization",
                       dest="moe_router_padding_for_fp8", action="store_true",
                       help="With --fp8-format: pad each expert's token count to a multiple of 16 with "
                       "probability-0 tokens (GEMM alignment; the output is unchanged up to the FP8 scales, whose "
                       "amaxes see the padded tokens).")
    group.add_argument("--moe-apply-probs-on-input", action="store_true",
                       help="Multiply each token by its routing probability before the expert instead of the "
                       "expert's output (--moe-router-topk 1 only).")
    group.add_argument("--moe-layer-recompute", action="store_true",
                       help="Recompute each MoE layer (router, dispatch, experts) in backward instead of keeping its "
                       "activations.")
    group.add_argument("--moe-per-layer-logging", action="store_true",
                       help="Log each MoE layer's auxiliary losses (<name>_layer_<i>, i the 0-based layer index) "
                       "besides their average.")
    for flag, what in (("--moe-permute-fusion", "a fused token permutation kernel"),
                       ("--moe-router-fusion", "a fused router top-k and score kernel"),
                       ("--moe-use-legacy-grouped-gemm", "the legacy grouped-GEMM package's kernel")):
        group.add_argument(flag, action="store_true",
                           help=f"Accepted for upstream scripts: upstream selects {what}; here the torch ops run "
                           "with or without it (no effect on results).")
    group.add_argument("--moe-enable-deepep", action="store_true",
                       help="Upstream: DeepEP's dispatcher (CUDA, with --moe-token-dispatcher-type flex). Not "
                       "provided by this build: an error.")
    group.add_argument("--moe-flex-dispatcher-backend", choices=("deepep", "hybridep"), default="deepep",
                       help="Upstream: the kernel library behind --moe-token-dispatcher-type flex, which this build "
                       "refuses (CUDA only); accepted for upstream scripts.")
    group.add_argument("--moe-hybridep-num-sms", type=int, default=16,
                       help="Accepted for upstream scripts: the streaming multiprocessors HybridEP uses; only "
                       "HybridEP reads it (no effect here).")
    group.add_argument("--overlap-moe-expert-parallel-comm", action="store_true",
                       help="Accepted for upstream scripts: upstream overlaps the expert-parallel token exchange of "
                       "one microbatch with another's compute on CUDA streams; here the exchange runs in order (no "
                       "effect on results).")
    group.add_argument("--moe-use-upcycling", action="store_true",
                       help="Build the MoE model from the dense checkpoint --load names: each expert of a MoE layer "
                       "starts as a copy of that layer's dense MLP, the router freshly initialised; the upcycled "
                       "checkpoint is written to --save (which must hold none) and training goes on from it. For the "
                       "first run only: later runs resume from --save without the flag (see docs/moe.md).")
    group.add_argument("--moe-upcycling-granularity", type=int, default=1,
                       help="Upstream: experts per dense MLP slice when upcycling; only 1 (each expert a full copy of "
                       "the dense MLP) is built.")
    group.add_argument("--moe-latent-size", type=int, default=None,
                       help="Latent MoE (Nemotron-3): project the routed tokens from the hidden width down to this "
                       "width before dispatch (fc1_latent_proj) and the combined output back (fc2_latent_proj); the "
                       "experts work in it, the router and the shared experts read the full hidden state.")
    group.add_argument("--use-fused-weighted-squared-relu", action="store_true",
                       help="Accepted for upstream scripts (with --squared-relu and --num-experts): upstream fuses the "
                       "experts' squared ReLU with the routing-probability weighting in one kernel; the torch ops "
                       "here compute the same product.")
    group.add_argument("--moe-deepep-num-sms", type=int, default=20,
                       help="Accepted for upstream scripts: the streaming multiprocessors DeepEP uses; only DeepEP "
                       "reads it (no effect here).")
    group.add_argument("--moe-extended-tp", action="store_true",
                       help="Deprecated and ignored upstream (since Megatron-Core 0.10): accepted with a warning; "
                       "split each expert over more ranks with --expert-tensor-parallel-size.")
    group.add_argument("--moe-router-topk-limited-devices", type=int, default=None,
                       help="Removed upstream: an error naming its replacement, --moe-router-num-groups (the "
                       "expert-parallel size) with --moe-router-group-topk (this value).")


def transformer_config_kwargs(args):
    """The MoE fields of `TransformerConfig` from the flags."""
    kwargs = {"expert_model_parallel_size": args.expert_model_parallel_size,
              "num_moe_experts": args.num_experts,
              "expert_tensor_parallel_size": args.expert_tensor_parallel_size,
              "moe_router_bias_update_rate": args.moe_router_bias_update_rate,
              "moe_router_load_balancing_type": args.moe_router_load_balancing_type,
              "moe_aux_loss_coeff": args.moe_aux_loss_coeff,
              "moe_token_drop_policy": args.moe_token_drop_policy}
    for field in _FIELDS_NEEDING_EXPERTS:
        kwargs[field] = getattr(args, _ARG_NAMES.get(field, field))
    return kwargs


def _uses_moe_flags(args):
    if args.num_experts is not None or args.expert_model_parallel_size != 1:
        return True
    return any(getattr(args, field) != default for field, (_, default) in _FIELDS_NEEDING_EXPERTS.items())


def _validate_upcycling(args):
    """--moe-use-upcycling (megatron/training/moe_upcycling.py): what it needs, and what it cannot copy."""
    granularity = args.moe_upcycling_granularity
    if granularity != 1:
        raise ValueError(f"--moe-upcycling-granularity {granularity}: granular upcycling (each dense MLP cut into "
                         f"{granularity} narrower experts) is not built; use 1 (each expert a copy of the dense MLP)")
    if not args.moe_use_upcycling:
        return
    needed = [flag for flag, value in (("--num-experts", args.num_experts), ("--load", args.load),
                                       ("--save", args.save)) if not value]
    if needed:
        raise ValueError(f"--moe-use-upcycling needs {', '.join(needed)}: --load names the dense checkpoint, the MoE "
                         "flags describe the model built from it, and --save receives the upcycled checkpoint")
    if args.ckpt_format not in ("torch_dist", "torch_dcp", "fsdp_dtensor"):
        raise ValueError(f"--moe-use-upcycling writes and loads a torch_dist checkpoint: --ckpt-format "
                         f"{args.ckpt_format} cannot load it; use --ckpt-format torch_dist")
    if args.moe_latent_size is not None:
        raise ValueError("--moe-use-upcycling copies the dense MLP into each expert, but with --moe-latent-size the "
                         "experts work in another width than the dense MLP: drop one of them")


def validate(args):
    if args.num_experts == 0:
        args.num_experts = None  # as upstream: no MoE
    if args.moe_enable_deepep:
        raise ValueError("--moe-enable-deepep needs DeepEP on CUDA GPUs, which this build does not provide: drop it "
                         "and use --moe-token-dispatcher-type alltoall (or allgather)")
    _validate_upcycling(args)
    if args.use_fused_weighted_squared_relu and not (args.squared_relu and args.num_experts):
        raise ValueError("--use-fused-weighted-squared-relu fuses the experts' squared ReLU: it needs --squared-relu "
                         "and --num-experts; add them or drop the flag")
    if args.moe_layer_recompute and args.recompute_granularity == "full":
        # Upstream's rule: full recompute already recomputes every layer, MoE layers included.
        raise ValueError("--moe-layer-recompute does not work with --recompute-granularity full (full recompute "
                         "already recomputes the whole layer, its MoE part included): drop one of them")
    if args.moe_deepep_num_sms <= 0:
        raise ValueError(f"--moe-deepep-num-sms must be positive, got {args.moe_deepep_num_sms}")
    devices, ep = args.moe_router_topk_limited_devices, args.expert_model_parallel_size
    if devices is not None:
        replacement = (f"use --moe-router-num-groups {ep} --moe-router-group-topk {devices} instead" if devices < ep
                       else f"at --expert-model-parallel-size {ep} it limits nothing: drop it")
        raise ValueError("--moe-router-topk-limited-devices was replaced upstream by group-limited routing (one "
                         f"group of experts per expert-parallel rank): {replacement}")
    if args.moe_extended_tp:
        warnings.warn("--moe-extended-tp is deprecated and ignored (as upstream since Megatron-Core 0.10): the "
                      "experts are split over --expert-tensor-parallel-size ranks; set that instead and drop "
                      "--moe-extended-tp")
    # One type and coefficient stay a str and a float (as before lists were accepted, and in saved checkpoint
    # args); several stay lists.
    kind, coeff = normalize_load_balancing(args.moe_router_load_balancing_type, args.moe_aux_loss_coeff)
    args.moe_router_load_balancing_type = list(kind) if isinstance(kind, tuple) else kind
    args.moe_aux_loss_coeff = list(coeff) if isinstance(coeff, tuple) else coeff
    ep = args.expert_model_parallel_size
    if ep < 1:
        raise ValueError(f"--expert-model-parallel-size must be at least 1, got {ep}")
    tp = args.tensor_model_parallel_size
    etp = tp if args.expert_tensor_parallel_size is None else args.expert_tensor_parallel_size
    if etp < 1:
        raise ValueError(f"--expert-tensor-parallel-size must be at least 1, got {etp}")
    stage_ranks = tp * args.data_parallel_size * args.context_parallel_size
    if stage_ranks % (etp * ep) != 0:
        raise ValueError(f"--expert-tensor-parallel-size x --expert-model-parallel-size ({etp} x {ep}) must divide "
                         f"--tensor-model-parallel-size x data-parallel size x --context-parallel-size ({tp} x "
                         f"{args.data_parallel_size} x {args.context_parallel_size}): the expert ranks of a pipeline "
                         "stage are its tensor-, data- and context-parallel ranks")
    if args.num_experts is not None and tp > 1 and not args.sequence_parallel \
            and not getattr(args, "generation_program", False):
        # Training only, as upstream; a generation program (megatron.inference.launch) runs MoE at TP > 1 without.
        raise ValueError(f"MoE layers (--num-experts {args.num_experts}) with --tensor-model-parallel-size {tp} "
                         "need --sequence-parallel for training (each tensor-parallel rank routes its own share of "
                         "the tokens): add --sequence-parallel")
    if args.num_experts is None:
        _warn_routing_flags_without_experts(args)
    else:
        _warn_moe_flags_without_effect(args)
    if not _uses_moe_flags(args):
        return
    from megatron.core.transformer.transformer_config import TransformerConfig

    # The fields the MoE rules read; the full config is built later from every group (model_config.py).
    TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, tensor_model_parallel_size=args.tensor_model_parallel_size,
        sequence_parallel=args.sequence_parallel, transformer_impl=args.transformer_impl, fp8=args.fp8_format,
        add_bias_linear=args.add_bias_linear, **transformer_config_kwargs(args),
    )  # raises ValueError naming the flags


def _warn_moe_flags_without_effect(args):
    """Settings of a MoE model that upstream accepts and never reads: a warning names them."""
    given = []
    if args.moe_router_load_balancing_type == "none" and args.moe_aux_loss_coeff:
        given.append(f"--moe-aux-loss-coeff {args.moe_aux_loss_coeff} (--moe-router-load-balancing-type none adds "
                     "no auxiliary loss)")
    dropless = args.moe_expert_capacity_factor is None or args.moe_expert_capacity_factor < 0
    if args.moe_token_drop_policy != "probs" and dropless:
        given.append(f"--moe-token-drop-policy {args.moe_token_drop_policy} (dropless without a positive "
                     "--moe-expert-capacity-factor: no token is dropped)")
    if given:
        warnings.warn(f"{'; '.join(given)}: without effect; drop them or set what they apply to")


def _warn_routing_flags_without_experts(args):
    """The MoE flags a dense model (no --num-experts) accepts, as upstream does, but never reads: a warning names
    those given (the flags that shape MoE layers stop instead, in MoEConfig)."""
    coeffs = args.moe_aux_loss_coeff if isinstance(args.moe_aux_loss_coeff, list) else [args.moe_aux_loss_coeff]
    given = [flag for flag, is_set in (
        ("--moe-aux-loss-coeff", any(coeff != 0.0 for coeff in coeffs)),
        ("--moe-router-load-balancing-type", args.moe_router_load_balancing_type != "aux_loss"),
        ("--moe-token-drop-policy", args.moe_token_drop_policy != "probs"),
        ("--moe-router-bias-update-rate", args.moe_router_bias_update_rate != 1e-3),
        ("--expert-tensor-parallel-size", args.expert_tensor_parallel_size not in (None,
                                                                                    args.tensor_model_parallel_size)),
    ) if is_set]
    if given:
        warnings.warn(f"{', '.join(given)}: MoE flags without effect on a model without experts; add --num-experts "
                      "or drop them")

"""Model-shape flags: layers, widths, heads, embeddings, normalisation, dropout, vocabulary padding, attention,
and the layer variants of upstream recipes (Qwen2's QKV bias, interleaved / interpolated RoPE, the residual's
placement and precision, GPT-2's tanh GeLU)."""

import argparse
import warnings

from megatron.core.transformer.yarn_config import YARN_FIELDS

DEFAULT_ROPE_SCALING_FACTOR = 8.0  # upstream's, Llama 3.1's
DEFAULT_INIT_METHOD_STD = 0.02
DEFAULT_ROTARY_BASE = 10000
POSITION_EMBEDDING_TYPES = ["learned_absolute", "rope", "yarn", "none"]
# Upstream values that need a model pretrain_gpt.py does not build: what to do instead.
REFUSED_POSITION_EMBEDDING_TYPES = {
    "mrope": "multimodal RoPE (Qwen2-VL) needs per-modality position ids from a vision-language model, and "
             "pretrain_gpt.py trains a text-only GPT: use --position-embedding-type rope",
    "relative": "relative position buckets belong to upstream's T5 encoder-decoder, not to GPT: use "
                "--position-embedding-type rope, learned_absolute or none",
}
ATTENTION_BACKENDS = ["auto", "local", "unfused", "flash", "fused"]
TRANSFORMER_ENGINE_ATTENTION_BACKENDS = ("flash", "fused")
# Upstream switches that turn off a fused kernel; every op here is already the unfused torch op.
UNFUSED_KERNEL_FLAGS = (
    "--no-persist-layer-norm",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
)


def add_arguments(parser):
    group = parser.add_argument_group("model")
    group.add_argument("--num-layers", type=int, default=None, help="Number of transformer layers.")
    group.add_argument("--hidden-size", type=int, default=None, help="Transformer hidden size.")
    group.add_argument(
        "--ffn-hidden-size",
        type=int,
        default=None,
        help="MLP hidden size; default 4 x hidden size (with --swiglu: 2/3 of that, rounded down to 64).",
    )
    group.add_argument("--num-attention-heads", type=int, default=None, help="Number of attention heads.")
    group.add_argument(
        "--kv-channels", type=int, default=None, help="Per-head projection size; default hidden size / heads."
    )
    group.add_argument("--seq-length", type=int, default=None, help="Sequence length of a training sample.")
    group.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="Size of the learned position table; default --seq-length.",
    )
    group.add_argument(
        "--position-embedding-type", default="learned_absolute",
        choices=[*POSITION_EMBEDDING_TYPES, *REFUSED_POSITION_EMBEDDING_TYPES],
        help="learned_absolute: a learned table of --max-position-embeddings rows; rope: rotary embeddings; yarn: "
        "rotary embeddings with YaRN's frequency scaling and cos / sin factor (the --yarn-* flags; gpt-oss); none: "
        "no position information (NoPE). mrope and relative are upstream's multimodal and T5 encodings, which "
        "pretrain_gpt.py does not offer (an error).",
    )
    group.add_argument(
        "--mrope-section", type=int, nargs="+", default=None,
        help="Upstream: the rotary channels given to each of --position-embedding-type mrope's position ids "
        "(temporal, height, width). mrope is not offered here: an error.",
    )
    group.add_argument(
        "--use-rotary-position-embeddings",
        action="store_const",
        const="rope",
        dest="position_embedding_type",
        help="Older spelling of --position-embedding-type rope.",
    )
    group.add_argument(
        "--no-position-embedding",
        action="store_false",
        dest="add_position_embedding",
        help="Upstream's older way to say there is no learned position table: accepted with --position-embedding-type "
        "rope, yarn or none (which have none), an error with learned_absolute.",
    )
    group.add_argument("--rotary-base", type=int, default=DEFAULT_ROTARY_BASE,
                       help="Base of rotary position embeddings.")
    group.add_argument(
        "--rotary-percent",
        type=float,
        default=1.0,
        help="Fraction of each head's channels that rotary embeddings rotate (the rest pass through).",
    )
    group.add_argument("--use-rope-scaling", action="store_true",
                       help="Llama 3.1's RoPE frequency scaling: frequencies whose wavelength exceeds 8192 positions "
                       "are divided by --rope-scaling-factor, those under 8192 / 4 are kept, the ones between are "
                       "blended (needs --position-embedding-type rope).")
    group.add_argument("--rope-scaling-factor", type=float, default=DEFAULT_ROPE_SCALING_FACTOR,
                       help="Divisor of the slow RoPE frequencies with --use-rope-scaling (Llama 3.1: 8, 3.2: 32).")
    _add_yarn_arguments(group)
    group.add_argument(
        "--group-query-attention",
        action="store_true",
        help="Grouped-query attention: --num-query-groups key/value heads, each shared by a group of query heads.",
    )
    group.add_argument(
        "--num-query-groups", type=int, default=1, help="Key/value heads with --group-query-attention."
    )
    group.add_argument("--qk-layernorm", action="store_true",
                       help="Normalise each query and key head before attention (same --normalization).")
    group.add_argument("--apply-layernorm-1p", action="store_true",
                       help="Zero-centred normalisation weights: store gamma - 1 and scale by 1 + weight.")
    group.add_argument("--squared-relu", action="store_true", help="MLP activation relu(x)^2 instead of GeLU.")
    group.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    group.add_argument("--norm-epsilon", type=float, default=1e-5, help="Epsilon of the normalisation layers.")
    group.add_argument("--swiglu", action="store_true", help="Gated SiLU MLP instead of GeLU.")
    group.add_argument("--quick-geglu", action="store_true",
                       help="Gated MLP whose gate goes through quick GeLU, x * sigmoid(1.702 x): "
                       "quick_gelu(gate) * up (gpt-oss); exclusive with --swiglu. --ffn-hidden-size defaults to "
                       "4 x hidden size, as upstream.")
    group.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="Separate output-layer weights instead of sharing the input embedding.",
    )
    group.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                       help="No biases in the linear layers.")
    group.add_argument("--init-method-std", type=float, default=DEFAULT_INIT_METHOD_STD,
                       help="Std of the normal weight init.")
    group.add_argument("--hidden-dropout", type=float, default=0.1, help="Dropout after attention and MLP.")
    group.add_argument("--attention-dropout", type=float, default=0.1, help="Dropout on attention probabilities.")
    group.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the vocabulary to a multiple of this value x tensor-parallel size.",
    )
    group.add_argument("--vocab-size", type=int, default=None,
                       help="Vocabulary size; NullTokenizer: the text ids 0..N-1, with the end-of-document id N "
                       "after them (N + 1 ids, as upstream).")
    group.add_argument(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="auto, local and unfused: torch's scaled_dot_product_attention, which picks its own kernel; flash "
        "and fused name Transformer Engine attention kernels, which this build does not use (an error).",
    )
    group.add_argument(
        "--use-flash-attn",
        action="store_true",
        help="Older spelling of --attention-backend flash (a Transformer Engine kernel this build does not use: an "
        "error).",
    )
    group.add_argument(
        "--attention-softmax-in-fp32",
        action="store_true",
        help="Accepted for upstream scripts: attention runs torch's scaled_dot_product_attention, whose fused "
        "kernels keep the softmax statistics in fp32 with bf16/fp16 inputs.",
    )
    group.add_argument(
        "--use-mcore-models",
        action="store_true",
        help="Accepted for upstream scripts: the models are always Megatron-Core models.",
    )
    _add_layer_variant_arguments(group)
    for flag in UNFUSED_KERNEL_FLAGS:
        group.add_argument(
            flag,
            action="store_true",
            help="Accepted for upstream scripts: this build has no fused kernels for it, the unfused torch ops "
            "always run.",
        )


def _add_layer_variant_arguments(group):
    group.add_argument("--add-qkv-bias", action="store_true",
                       help="A bias on the QKV projection (linear_qkv.bias) even with --disable-bias-linear "
                       "(Qwen2-style).")
    group.add_argument("--rotary-interleaved", action="store_true",
                       help="RoPE rotates the channel pairs (0,1), (2,3), ... instead of (i, i + rotated/2).")
    group.add_argument("--rotary-seq-len-interpolation-factor", type=float, default=None,
                       help="RoPE positions are divided by this factor (linear position interpolation).")
    group.add_argument("--apply-residual-connection-post-layernorm", action="store_true",
                       help="The residual around attention and MLP is their normalised input (original BERT "
                       "ordering) instead of the un-normalised one.")
    group.add_argument("--fp32-residual-connection", action="store_true",
                       help="With --bf16/--fp16: keep the residual stream (and what pipeline stages exchange) in "
                       "fp32; norms and sublayers still compute in the parameters' dtype.")
    group.add_argument("--openai-gelu", action="store_true",
                       help="MLP activation: GeLU's tanh approximation (GPT-2's) instead of the exact erf GeLU.")
    group.add_argument("--use-cpu-initialization", action="store_true",
                       help="Allocate and initialise the weights in host memory, then move the model to its device. "
                       "Initial values are drawn on the host in every case, so they are the same either way; this "
                       "only moves where the parameters are first allocated.")
    group.add_argument("--no-initialization", action="store_false", dest="perform_initialization",
                       help="Allocate the weights without drawing their random initial values (biases and norms are "
                       "still set), to start faster when a checkpoint (--load, --pretrained-checkpoint) overwrites "
                       "them right after; without one the weights hold whatever the memory held.")
    group.add_argument("--init-method-xavier-uniform", action="store_true",
                       help="Initialise every weight matrix (the embeddings too, unless --embedding-init-method-std "
                       "is given) from U(-a, a), a = sqrt(6 / (fan_in + fan_out)) of the full unsharded weight, "
                       "instead of normal(0, --init-method-std); the output projections are not scaled by depth.")
    group.add_argument("--activation-func-clamp-value", type=float, default=None,
                       help="Gated MLP (--swiglu, --quick-geglu): clamp the gate to at most this value and the up "
                       "projection to [-value, value] before the activation (gpt-oss: 7).")
    group.add_argument("--glu-linear-offset", type=float, default=0.0,
                       help="Gated MLP (--swiglu, --quick-geglu): act(gate) * (up + offset) (gpt-oss: 1).")
    group.add_argument("--embedding-init-method-std", type=float, default=None,
                       help="Std of the zero-mean normal init of the embedding weights (word and learned position "
                       "embeddings; with tied weights also the output layer, which is the word embedding); setting "
                       "it also exempts them from weight decay. An untied output layer keeps --init-method-std. "
                       "Default: the embeddings initialise like the other weights and take weight decay.")


def transformer_config_kwargs(args):
    """The TransformerConfig fields of the layer-variant flags, the MLP activation and the embedding init."""
    from megatron.core.activations import quick_gelu, squared_relu
    from megatron.core.transformer.init_methods import XavierUniformInit
    from megatron.core.transformer.utils import openai_gelu

    activation_func = None  # the config's default: gelu, or silu for --swiglu
    if getattr(args, "quick_geglu", False):  # gated: core_transformer_config_from_args sets gated_linear_unit
        activation_func = quick_gelu
    elif args.squared_relu:
        activation_func = squared_relu
    elif args.openai_gelu:
        activation_func = openai_gelu
    # None: the config's defaults, normal(0, std) and its depth-scaled variant for the output projections.
    init_method = XavierUniformInit() if args.init_method_xavier_uniform else None
    return dict(
        activation_func=activation_func,
        activation_func_clamp_value=args.activation_func_clamp_value,
        glu_linear_offset=args.glu_linear_offset,
        init_method=init_method,
        output_layer_init_method=init_method,
        add_qkv_bias=args.add_qkv_bias,
        rotary_interleaved=args.rotary_interleaved,
        rotary_seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        apply_residual_connection_post_layernorm=args.apply_residual_connection_post_layernorm,
        fp32_residual_connection=args.fp32_residual_connection,
        use_cpu_initialization=args.use_cpu_initialization,
        perform_initialization=args.perform_initialization,
        embedding_init_method_std=args.embedding_init_method_std,
        **{name: getattr(args, name) for name in YARN_FIELDS},
    )


def _add_yarn_arguments(group):
    """YaRN of standard attention (--position-embedding-type yarn); multi-latent attention's is --rope-type yarn."""
    helps = {
        "yarn_rotary_scaling_factor": "YaRN: the factor s by which the trained context is stretched (gpt-oss: 32).",
        "yarn_original_max_position_embeddings": "YaRN: the context length the unscaled RoPE was trained for.",
        "yarn_beta_fast": "YaRN: frequencies turning more often than this over the original context are kept.",
        "yarn_beta_slow": "YaRN: frequencies turning less often than this over the original context are divided "
                          "by s; those between are blended.",
        "yarn_mscale": "YaRN: cos and sin are multiplied by ms(s, mscale) / ms(s, mscale-all-dim), ms(s, a) = "
                       "0.1 a ln(s) + 1 (1 for s <= 1).",
        "yarn_mscale_all_dim": "YaRN: see --yarn-mscale.",
    }
    types = {"yarn_original_max_position_embeddings": int}
    for name, (flag, default) in YARN_FIELDS.items():
        if name == "yarn_correction_range_round_to_int":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                               help="YaRN: round the blended channel range outwards to whole channel pairs "
                               "(default; the paper's rule); --no-yarn-correction-range-round-to-int keeps its "
                               "fractional bounds (gpt-oss, HF's truncate false).")
        else:
            group.add_argument(flag, type=types.get(name, float), default=default, help=helps[name])


def _validate_yarn(args):
    if args.position_embedding_type == "yarn":
        if args.rotary_seq_len_interpolation_factor is not None:
            raise ValueError("--rotary-seq-len-interpolation-factor does not combine with --position-embedding-type "
                             "yarn, which scales the frequencies itself (--yarn-rotary-scaling-factor): drop it")
        return
    changed = [flag for name, (flag, default) in YARN_FIELDS.items() if getattr(args, name) != default]
    if changed:
        raise ValueError(f"{', '.join(changed)} shape(s) YaRN rotary embeddings: add --position-embedding-type yarn "
                         f"(got {args.position_embedding_type}) or drop them")


def _validate_position_embedding(args):
    refused = REFUSED_POSITION_EMBEDDING_TYPES.get(args.position_embedding_type)
    if refused:
        raise ValueError(f"--position-embedding-type {args.position_embedding_type} is not offered: {refused}")
    if args.mrope_section is not None:
        raise ValueError(f"--mrope-section splits the rotary channels of --position-embedding-type mrope, which is "
                         f"not offered: {REFUSED_POSITION_EMBEDDING_TYPES['mrope']}, and drop --mrope-section")
    if not args.add_position_embedding and args.position_embedding_type == "learned_absolute":
        raise ValueError("--no-position-embedding asks for a model without a learned position table, but "
                         "--position-embedding-type is learned_absolute, which is one: add --position-embedding-type "
                         "rope (as upstream requires) or none (no position information), or drop "
                         "--no-position-embedding")
    rotary = args.position_embedding_type in ("rope", "yarn") or getattr(args, "multi_latent_attention", False)
    if rotary and not args.rotary_base > 0:
        raise ValueError(f"--rotary-base must be positive, got {args.rotary_base} (Llama 3: 500000, default 10000)")
    if args.position_embedding_type in ("rope", "yarn") and not getattr(args, "multi_latent_attention", False):
        _validate_rotary_dim(args)
    if not rotary:
        for flag, value, default in (("--rotary-base", args.rotary_base, DEFAULT_ROTARY_BASE),
                                     ("--rotary-percent", args.rotary_percent, 1.0)):
            if value != default:
                warnings.warn(f"{flag} {value} has no effect with --position-embedding-type "
                              f"{args.position_embedding_type} (no rotary embeddings); add --position-embedding-type "
                              f"rope or drop {flag}")


def _validate_rotary_dim(args):
    # Same rule as RotaryEmbedding's, checked here so that it stops before any rank builds a model.
    rotary_dim = int(args.kv_channels * args.rotary_percent)
    if rotary_dim < 2 or rotary_dim % 2 != 0:
        raise ValueError(f"--kv-channels ({args.kv_channels}) x --rotary-percent ({args.rotary_percent}) gives "
                         f"{rotary_dim} rotated channels per head, but RoPE rotates channel pairs: it needs an even "
                         "number >= 2; change --rotary-percent or --kv-channels (default --hidden-size / "
                         "--num-attention-heads)")


def _validate_layer_variants(args):
    _validate_yarn(args)
    if args.position_embedding_type not in ("rope", "yarn"):
        for flag, value in (("--rotary-interleaved", args.rotary_interleaved),
                            ("--rotary-seq-len-interpolation-factor", args.rotary_seq_len_interpolation_factor)):
            if value:
                raise ValueError(f"{flag} shapes rotary position embeddings: it needs --position-embedding-type "
                                 f"rope (got {args.position_embedding_type}); add that or drop {flag}")
    _validate_rope_scaling(args)
    factor = args.rotary_seq_len_interpolation_factor
    if factor is not None and factor <= 0:
        raise ValueError(f"--rotary-seq-len-interpolation-factor must be positive, got {factor}")
    if args.openai_gelu and (args.swiglu or args.squared_relu):
        other = "--swiglu" if args.swiglu else "--squared-relu"
        raise ValueError(f"--openai-gelu and {other} are exclusive MLP activations: pick one")
    if args.fp32_residual_connection and not (args.bf16 or args.fp16):
        raise ValueError("--fp32-residual-connection keeps the residual in fp32 under --bf16 or --fp16; with fp32 "
                         "parameters it is already fp32: drop the flag")
    if args.embedding_init_method_std is not None and args.embedding_init_method_std <= 0:
        raise ValueError(f"--embedding-init-method-std must be positive, got {args.embedding_init_method_std}")
    if args.quick_geglu:
        for other, given in (("--swiglu", args.swiglu), ("--squared-relu", args.squared_relu),
                             ("--openai-gelu", args.openai_gelu)):
            if given:
                raise ValueError(f"--quick-geglu and {other} are exclusive MLP activations: pick one")
    if not (args.swiglu or args.quick_geglu):
        for flag, given in (("--activation-func-clamp-value", args.activation_func_clamp_value is not None),
                            ("--glu-linear-offset", args.glu_linear_offset != 0.0)):
            if given:
                raise ValueError(f"{flag} shapes the gated MLP (act(gate) * up): it needs --swiglu or "
                                 f"--quick-geglu; add one or drop {flag}")
    if args.init_method_xavier_uniform and args.init_method_std != DEFAULT_INIT_METHOD_STD:
        warnings.warn(f"--init-method-std {args.init_method_std} has no effect with --init-method-xavier-uniform "
                      "(the bound comes from each weight's shape); drop one of them")
    if args.activation_func_clamp_value is not None and not args.activation_func_clamp_value > 0:
        raise ValueError(f"--activation-func-clamp-value must be positive, got {args.activation_func_clamp_value}")


def _validate_rope_scaling(args):
    if not args.rope_scaling_factor > 0:
        raise ValueError(f"--rope-scaling-factor must be positive, got {args.rope_scaling_factor}")
    if not args.use_rope_scaling:
        if args.rope_scaling_factor != DEFAULT_ROPE_SCALING_FACTOR:
            warnings.warn(f"--rope-scaling-factor {args.rope_scaling_factor} has no effect without "
                          "--use-rope-scaling; add --use-rope-scaling to scale the RoPE frequencies")
        return
    if getattr(args, "multi_latent_attention", False):
        raise ValueError("--use-rope-scaling scales the RoPE of ordinary attention; --multi-latent-attention has its "
                         "own rotary embedding (--rope-type), which it would not change: drop --use-rope-scaling")
    if args.position_embedding_type != "rope":
        raise ValueError(f"--use-rope-scaling scales rotary position embeddings: it needs --position-embedding-type "
                         f"rope (got {args.position_embedding_type}); add that or drop --use-rope-scaling")


def _swiglu_ffn_hidden_size(hidden_size):
    # Keeps the gated MLP's parameter count close to the 4h GeLU MLP's: 3 matrices of 2/3 the width.
    return int((4 * hidden_size * 2 / 3) / 64) * 64


def validate(args):
    for flag, value in (
        ("--num-layers", args.num_layers),
        ("--hidden-size", args.hidden_size),
        ("--num-attention-heads", args.num_attention_heads),
        ("--seq-length", args.seq_length),
    ):
        if value is None:
            raise ValueError(f"{flag} is required")
        if value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    for flag, value in (("--kv-channels", args.kv_channels), ("--ffn-hidden-size", args.ffn_hidden_size)):
        if value is not None and value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}; drop it for the default derived from "
                             "--hidden-size")
    if args.hidden_size % args.num_attention_heads != 0 and args.kv_channels is None:
        raise ValueError(
            f"--hidden-size ({args.hidden_size}) must be divisible by --num-attention-heads "
            f"({args.num_attention_heads}), or set --kv-channels"
        )
    if args.num_attention_heads % args.tensor_model_parallel_size != 0:
        raise ValueError(
            f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
            f"--tensor-model-parallel-size ({args.tensor_model_parallel_size})"
        )
    if args.hidden_size % args.tensor_model_parallel_size != 0:
        raise ValueError(
            f"--hidden-size ({args.hidden_size}) must be divisible by --tensor-model-parallel-size "
            f"({args.tensor_model_parallel_size})"
        )
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = _swiglu_ffn_hidden_size(args.hidden_size) if args.swiglu else 4 * args.hidden_size
        if args.ffn_hidden_size == 0:
            raise ValueError(f"--swiglu's default --ffn-hidden-size (2/3 of 4 x --hidden-size, rounded down to a "
                             f"multiple of 64) is 0 for --hidden-size {args.hidden_size}: pass --ffn-hidden-size")
    if args.ffn_hidden_size % args.tensor_model_parallel_size != 0:
        raise ValueError(
            f"--ffn-hidden-size ({args.ffn_hidden_size}) must be divisible by "
            f"--tensor-model-parallel-size ({args.tensor_model_parallel_size})"
        )
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute" and args.seq_length > args.max_position_embeddings:
        raise ValueError(
            f"--seq-length ({args.seq_length}) must not exceed --max-position-embeddings "
            f"({args.max_position_embeddings}) with learned absolute position embeddings (the table has one row "
            "per position): raise --max-position-embeddings, shorten --seq-length, or use --position-embedding-type "
            "rope"
        )
    for flag, value in (("--hidden-dropout", args.hidden_dropout), ("--attention-dropout", args.attention_dropout)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{flag} must be in [0, 1), got {value}")
    if args.use_flash_attn:
        raise ValueError(
            "--use-flash-attn asks for the flash-attention kernel, which this build does not use; drop it: "
            "--attention-backend auto (the default) runs torch's scaled_dot_product_attention, which picks a "
            "flash kernel by itself where the device has one"
        )
    if not 0.0 < args.rotary_percent <= 1.0:
        raise ValueError(f"--rotary-percent must be in (0, 1], got {args.rotary_percent}")
    _validate_attention_shape(args)
    _validate_position_embedding(args)
    _validate_layer_variants(args)
    if args.squared_relu and args.swiglu:
        raise ValueError("--squared-relu and --swiglu are exclusive MLP activations: pick one")
    if args.attention_backend in TRANSFORMER_ENGINE_ATTENTION_BACKENDS:
        raise ValueError(
            f"--attention-backend {args.attention_backend} is a Transformer Engine kernel (GPU) that this build "
            "does not use; pass --attention-backend auto, local or unfused (torch's scaled_dot_product_attention)"
        )
    if args.make_vocab_size_divisible_by <= 0:
        raise ValueError(f"--make-vocab-size-divisible-by must be positive, got {args.make_vocab_size_divisible_by}")


def _validate_attention_shape(args):
    if not args.group_query_attention:
        if args.num_query_groups != 1:  # 1 is the default; upstream ignores the value without the switch too
            warnings.warn(f"--num-query-groups {args.num_query_groups} has no effect without --group-query-attention: "
                          f"every one of the {args.num_attention_heads} attention heads gets its own key/value head; "
                          "add --group-query-attention for grouped-query attention")
        args.num_query_groups = args.num_attention_heads
        return
    groups = args.num_query_groups
    if groups <= 0 or args.num_attention_heads % groups != 0:
        raise ValueError(
            f"--num-query-groups ({groups}) must be a positive divisor of --num-attention-heads "
            f"({args.num_attention_heads})"
        )
    if groups % args.tensor_model_parallel_size != 0:
        raise ValueError(
            f"--num-query-groups ({groups}) must be divisible by --tensor-model-parallel-size "
            f"({args.tensor_model_parallel_size}): each tensor-parallel rank holds whole query groups"
        )

"""Model-shape flags: layers, widths, heads, embeddings, normalisation, dropout, vocabulary padding, attention."""

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
        "--position-embedding-type", default="learned_absolute", choices=["learned_absolute", "rope"]
    )
    group.add_argument(
        "--use-rotary-position-embeddings",
        action="store_const",
        const="rope",
        dest="position_embedding_type",
        help="Older spelling of --position-embedding-type rope.",
    )
    group.add_argument("--rotary-base", type=int, default=10000, help="Base of rotary position embeddings.")
    group.add_argument(
        "--rotary-percent",
        type=float,
        default=1.0,
        help="Fraction of each head's channels that rotary embeddings rotate (the rest pass through).",
    )
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
    group.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="Separate output-layer weights instead of sharing the input embedding.",
    )
    group.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                       help="No biases in the linear layers.")
    group.add_argument("--init-method-std", type=float, default=0.02, help="Std of the normal weight init.")
    group.add_argument("--hidden-dropout", type=float, default=0.1, help="Dropout after attention and MLP.")
    group.add_argument("--attention-dropout", type=float, default=0.1, help="Dropout on attention probabilities.")
    group.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the vocabulary to a multiple of this value x tensor-parallel size.",
    )
    group.add_argument("--vocab-size", type=int, default=None, help="Vocabulary size (needed by NullTokenizer).")
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
    for flag in UNFUSED_KERNEL_FLAGS:
        group.add_argument(
            flag,
            action="store_true",
            help="Accepted for upstream scripts: this build has no fused kernels for it, the unfused torch ops "
            "always run.",
        )


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
            f"({args.max_position_embeddings}) with learned absolute position embeddings"
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
    _validate_attention_shape(args)
    if args.squared_relu and args.swiglu:
        raise ValueError("--squared-relu and --swiglu are exclusive MLP activations: pick one")
    if not 0.0 < args.rotary_percent <= 1.0:
        raise ValueError(f"--rotary-percent must be in (0, 1], got {args.rotary_percent}")
    if args.attention_backend in TRANSFORMER_ENGINE_ATTENTION_BACKENDS:
        raise ValueError(
            f"--attention-backend {args.attention_backend} is a Transformer Engine kernel (GPU) that this build "
            "does not use; pass --attention-backend auto, local or unfused (torch's scaled_dot_product_attention)"
        )
    if args.make_vocab_size_divisible_by <= 0:
        raise ValueError(f"--make-vocab-size-divisible-by must be positive, got {args.make_vocab_size_divisible_by}")


def _validate_attention_shape(args):
    if not args.group_query_attention:
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

"""Numerics flags of the loss, attention and matmuls: the fused vocab-parallel cross entropy, upstream's fp16
cross-entropy switch, its query-key layer scaling (an fp16 overflow guard) and
`--disable-bf16-reduced-precision-matmul` (applied at start-up by `megatron.training.initialize`)."""


def add_arguments(parser):
    group = parser.add_argument_group("numerics")
    group.add_argument("--cross-entropy-loss-fusion", action="store_true",
                       help="Fused vocab-parallel cross entropy: logits stay in their dtype (fp32 work on row "
                       "chunks only), one all-reduce of the target logit and the exponential sum after the max.")
    group.add_argument("--cross-entropy-fusion-impl", default="native", choices=["native", "te"],
                       help="native: this build's fused cross entropy; te (Transformer Engine's kernel) is not "
                       "used by this build: an error.")
    group.add_argument("--fp16-lm-cross-entropy", action="store_true",
                       help="Accepted for upstream scripts: as in Megatron-Core's GPT model, the language-model cross "
                       "entropy works in fp32 with --fp16 or --bf16 whether or not this is given.")
    group.add_argument("--apply-query-key-layer-scaling", action="store_true",
                       help="With --fp16: compute attention scores as Q.K^T / (sqrt(d) x layer number) in fp16 and "
                       "multiply them back by the layer number in fp32 before the softmax (overflow guard); with "
                       "fp32 or bf16 inputs it changes nothing, as upstream.")
    group.add_argument("--disable-bf16-reduced-precision-matmul", action="store_true",
                       help="Set torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False, so bf16 "
                       "GEMMs on CUDA reduce their partial sums in fp32 (cuBLAS may otherwise use bf16 reductions). "
                       "CPU matmuls do not read the switch: no effect there.")


def validate(args):
    if args.cross_entropy_fusion_impl == "te":
        raise ValueError("--cross-entropy-fusion-impl te needs Transformer Engine's fused kernel, which this build "
                         "does not use; pass --cross-entropy-fusion-impl native (the default)")
    if args.apply_query_key_layer_scaling and args.fp16 and args.context_parallel_size > 1:
        raise ValueError("--apply-query-key-layer-scaling with --fp16 is not supported with "
                         "--context-parallel-size > 1; drop one of them")


def transformer_config_kwargs(args):
    return dict(cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
                apply_query_key_layer_scaling=args.apply_query_key_layer_scaling)

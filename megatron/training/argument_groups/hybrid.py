"""Hybrid (Mamba) model flags, upstream's names and defaults (`pretrain_mamba.py`; megatron/core/ssm/).

A hybrid model is asked for by `--is-hybrid-model` (pretrain_mamba.py sets it), `--hybrid-override-pattern` or a
nonzero `--hybrid-attention-ratio` / `--hybrid-mlp-ratio`; validation resolves its layers into
`args.hybrid_layer_pattern` (None for a GPT model).
"""

from megatron.core.ssm.mamba_config import MAMBA, check_mamba_shape, hybrid_moe_layer_freq
from megatron.core.ssm.mamba_hybrid_layer_allocation import allocate_layers

MAMBA_SPEC = ["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"]


def add_arguments(parser):
    group = parser.add_argument_group("hybrid (Mamba) models")
    group.add_argument("--is-hybrid-model", action="store_true", default=None,
                       help="Train a hybrid model of Mamba-2, attention and MLP layers (pretrain_mamba.py sets it).")
    group.add_argument("--hybrid-attention-ratio", type=float, default=0.0,
                       help="Share of attention layers ('*') of a hybrid model.")
    group.add_argument("--hybrid-mlp-ratio", type=float, default=0.0, help="Share of MLP layers ('-').")
    group.add_argument("--hybrid-override-pattern", default=None,
                       help="The layers of a hybrid model, one symbol each: M Mamba, * attention, - MLP, E MoE "
                       "(e.g. M-M*-ME); overrides the ratios.")
    group.add_argument("--mamba-state-dim", type=int, default=128, help="State size of each Mamba head.")
    group.add_argument("--mamba-head-dim", type=int, default=64, help="Channels of each Mamba head.")
    group.add_argument("--mamba-num-groups", type=int, default=8,
                       help="Groups of Mamba heads sharing B and C (a multiple of the tensor-parallel size).")
    group.add_argument("--mamba-num-heads", type=int, default=None,
                       help="Mamba heads (default: 2 x --hidden-size / --mamba-head-dim).")
    group.add_argument("--mamba-dt-limit", type=float, nargs=2, default=None, metavar=("LOW", "HIGH"),
                       help="Clamp each Mamba step softplus(dt + dt_bias) to [LOW, HIGH] (HIGH may be inf), as "
                       "transformers' Nemotron-H (from below at time_step_min) and Mamba2 (time_step_limit) do; "
                       "default: no clamp, as upstream's mixer.")
    group.add_argument("--disable-mamba-mem-eff-path", action="store_true",
                       help="Accepted for upstream scripts: upstream then runs the mixer's unfused kernels; the "
                       "mixer here is plain torch either way.")


def hybrid_model_asked(args):
    return bool(args.is_hybrid_model or args.hybrid_override_pattern is not None or args.hybrid_attention_ratio
                or args.hybrid_mlp_ratio)


def validate(args):
    args.is_hybrid_model = hybrid_model_asked(args)
    args.hybrid_layer_pattern = None
    if args.spec is not None and list(args.spec) == MAMBA_SPEC:
        if not args.is_hybrid_model:
            raise ValueError(f"--spec {' '.join(MAMBA_SPEC)} builds a hybrid model: launch pretrain_mamba.py (or add "
                             "--is-hybrid-model)")
        args.spec = None  # the hybrid stack is what the pattern builds
    if not args.is_hybrid_model:
        return
    args.hybrid_layer_pattern = allocate_layers(args.num_layers, args.hybrid_attention_ratio, args.hybrid_mlp_ratio,
                                                args.hybrid_override_pattern)
    freq = hybrid_moe_layer_freq(args.hybrid_layer_pattern, args.num_experts, args.moe_layer_freq)
    args.moe_layer_freq = list(freq) if isinstance(freq, tuple) else freq
    if MAMBA in args.hybrid_layer_pattern:
        check_mamba_shape(args.hidden_size, args.mamba_head_dim, args.mamba_num_heads, args.mamba_num_groups,
                          args.tensor_model_parallel_size, args.context_parallel_size)


def transformer_config_kwargs(args):
    return dict(hybrid_layer_pattern=getattr(args, "hybrid_layer_pattern", None),
                mamba_state_dim=args.mamba_state_dim, mamba_head_dim=args.mamba_head_dim,
                mamba_num_groups=args.mamba_num_groups, mamba_num_heads=args.mamba_num_heads,
                **({} if args.mamba_dt_limit is None else {"mamba_dt_limit": tuple(args.mamba_dt_limit)}))

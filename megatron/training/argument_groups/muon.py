"""Muon flags (`--optimizer muon`): upstream's names and defaults; see megatron/core/optimizer/muon.py.

Muon runs under every data-parallel wrapper: with the distributed optimizer, Megatron-FSDP and FSDP2 it assembles
each whole weight matrix from the data-parallel shards before Newton-Schulz.
"""

from megatron.core.optimizer.optimizer_config import MUON_FP32_MATMUL_PRECISIONS, MUON_SCALE_MODES, MUON_TP_MODES


def add_arguments(parser):
    group = parser.add_argument_group("muon")
    group.add_argument("--muon-momentum", type=float, default=0.95,
                       help="Muon momentum: M <- mu M + (1 - mu) G.")
    group.add_argument("--muon-use-nesterov", action="store_true",
                       help="Orthogonalize the Nesterov update (1 - mu) G + mu M instead of M.")
    group.add_argument("--muon-num-ns-steps", type=int, default=5, help="Newton-Schulz iterations per step.")
    group.add_argument("--muon-scale-mode", default="spectral", choices=list(MUON_SCALE_MODES),
                       help="Scale of the orthogonalized rows x cols update: spectral sqrt(max(rows, cols)), "
                       "unit_rms_norm sqrt(rows / cols), shape_scaling sqrt(max(1, rows / cols)).")
    group.add_argument("--muon-extra-scale-factor", type=float, default=1.0,
                       help="Multiplies the scaled update (e.g. 0.2 with spectral to match AdamW's update size).")
    group.add_argument("--muon-split-qkv", dest="muon_split_qkv", action="store_true", default=True,
                       help="Orthogonalize the fused QKV weight as separate Q, K and V matrices (default).")
    group.add_argument("--muon-no-split-qkv", dest="muon_split_qkv", action="store_false",
                       help="Orthogonalize the fused QKV weight as one matrix.")
    group.add_argument("--muon-fp32-matmul-prec", default="medium", choices=list(MUON_FP32_MATMUL_PRECISIONS),
                       help="fp32 matmul precision of Newton-Schulz on GPU: low (bf16), medium (TF32), high (fp32). "
                       "CPU matmuls are always full fp32.")
    group.add_argument("--muon-tp-mode", default="blockwise", choices=list(MUON_TP_MODES),
                       help="Tensor-parallel weights: blockwise orthogonalizes each rank's shard; duplicated gathers "
                       "the full matrix on every rank; distributed runs Newton-Schulz on the shards with "
                       "all-reduces. duplicated and distributed give the single-rank update.")


def validate(args):
    if args.optimizer != "muon":
        return
    if not 0 <= args.muon_momentum < 1:
        raise ValueError(f"--muon-momentum must be in [0, 1), got {args.muon_momentum}")
    if args.muon_num_ns_steps < 1:
        raise ValueError(f"--muon-num-ns-steps must be at least 1, got {args.muon_num_ns_steps}")
    if args.muon_extra_scale_factor <= 0:
        raise ValueError(f"--muon-extra-scale-factor must be > 0, got {args.muon_extra_scale_factor}")


def optimizer_config_kwargs(args):
    """The Muon fields of OptimizerConfig."""
    return dict(muon_momentum=args.muon_momentum, muon_use_nesterov=args.muon_use_nesterov,
                muon_num_ns_steps=args.muon_num_ns_steps, muon_scale_mode=args.muon_scale_mode,
                muon_extra_scale_factor=args.muon_extra_scale_factor, muon_split_qkv=args.muon_split_qkv,
                muon_fp32_matmul_prec=args.muon_fp32_matmul_prec, muon_tp_mode=args.muon_tp_mode)

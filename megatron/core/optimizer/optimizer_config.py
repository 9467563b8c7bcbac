"""`OptimizerConfig`: what to optimize with, at which precision, and how to scale and clip gradients."""

from dataclasses import dataclass, field
from typing import Optional

import torch

SUPPORTED_OPTIMIZERS = ("adam", "sgd", "muon")
MUON_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MUON_TP_MODES = ("blockwise", "duplicated", "distributed")
MUON_FP32_MATMUL_PRECISIONS = ("low", "medium", "high")
# Upstream's choices for the precision-aware optimizer's dtypes (fp8 moments need Transformer Engine: not here).
PRECISION_AWARE_DTYPES = {
    "main_params_dtype": (torch.float32, torch.float16),
    "main_grads_dtype": (torch.float32, torch.bfloat16),
    "exp_avg_dtype": (torch.float32, torch.bfloat16, torch.float16),
    "exp_avg_sq_dtype": (torch.float32, torch.bfloat16, torch.float16),
}


@dataclass(frozen=True)
class OptimizerConfig:
    """Settings read by `get_megatron_optimizer`; validated once, at construction."""

    optimizer: str = "adam"
    """`adam` (AdamW: decoupled weight decay), `sgd` (with momentum) or `muon` (Muon for the hidden weight matrices,
    AdamW with the adam_* settings for embeddings, the output layer, biases and norms; see muon.py)."""

    lr: Optional[float] = None
    """Peak learning rate. The scheduler overwrites the optimizer's lr every step from this value."""

    min_lr: Optional[float] = None
    """Learning rate at the end of decay (None: 0)."""

    decoupled_lr: Optional[float] = None
    """Peak learning rate of the word-embedding and output-layer weights (None: `lr`, as every parameter)."""

    decoupled_min_lr: Optional[float] = None
    """Their learning rate at the end of decay (None: `min_lr`); needs `decoupled_lr`."""

    weight_decay: float = 0.01
    """Decoupled weight decay for weights with two or more dimensions; biases and norms get none."""

    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9

    muon_momentum: float = 0.95
    """Muon's momentum (an average of gradients: M <- mu M + (1 - mu) G)."""

    muon_use_nesterov: bool = False
    """Muon orthogonalizes (1 - mu) G + mu M instead of M."""

    muon_num_ns_steps: int = 5
    """Newton-Schulz iterations per Muon step."""

    muon_scale_mode: str = "spectral"
    """Scale of the orthogonalized update: spectral, unit_rms_norm or shape_scaling."""

    muon_extra_scale_factor: float = 1.0
    """Multiplies the scaled Muon update."""

    muon_split_qkv: bool = True
    """Orthogonalize the fused QKV weight as separate Q, K and V matrices."""

    muon_fp32_matmul_prec: str = "medium"
    """Precision of Newton-Schulz's fp32 matmuls on an accelerator: low (bf16), medium (TF32), high (fp32)."""

    muon_tp_mode: str = "blockwise"
    """Tensor-parallel weights: blockwise (per shard), duplicated (gather, full NS), distributed (sharded NS)."""

    clip_grad: float = 1.0
    """Clip the global L2 norm of the gradients to this value; 0 disables clipping."""

    bf16: bool = False
    """The model's parameters are bf16: keep fp32 main parameters, no loss scaling."""

    fp16: bool = False
    """The model's parameters are fp16: keep fp32 main parameters and scale the loss."""

    params_dtype: torch.dtype = torch.float32

    loss_scale: Optional[float] = None
    """Static loss scale for fp16; None selects dynamic loss scaling."""

    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    """Steps without overflow after which the dynamic loss scale doubles."""

    hysteresis: int = 2
    """Overflowing steps tolerated before the dynamic loss scale is halved."""

    use_distributed_optimizer: bool = False
    """Shard the fp32 main parameters and optimizer state over the data-parallel group (ZeRO-1)."""

    log_num_zeros_in_grad: bool = False
    """Count zero gradient entries each step (returned by `step()`)."""

    barrier_with_L1_time: bool = False
    """The level-1 timers of `step()`'s phases pass a barrier when they start, so they time the slowest rank
    (False here as upstream; `pretrain()` passes `args.barrier_with_L1_time`, True unless
    `--no-barrier-with-level-1-timing`)."""

    timers: Optional[object] = field(default=None, compare=False, repr=False)
    """`megatron.core.timers.Timers` of the run: `step()` times its phases at level 1 (None: nothing is timed)."""

    use_precision_aware_optimizer: bool = False
    """Keep main parameters and Adam moments in the dtypes below (`--use-precision-aware-optimizer`, see
    precision_aware_adam.py); needs the distributed optimizer and Adam."""

    main_params_dtype: torch.dtype = torch.float32
    """Distributed optimizer: dtype of the sharded main parameters (fp32 or fp16, `--main-params-dtype`)."""

    main_grads_dtype: torch.dtype = torch.float32
    """dtype of the gradients the optimizer reads (fp32 or bf16, `--main-grads-dtype`); it is the gradient
    buffers' dtype, set on `DistributedDataParallelConfig.grad_reduce_in_fp32` by the command line."""

    exp_avg_dtype: torch.dtype = torch.float32
    """Adam's first moment (fp32, bf16 or fp16, `--exp-avg-dtype`)."""

    exp_avg_sq_dtype: torch.dtype = torch.float32
    """Adam's second moment (fp32, bf16 or fp16, `--exp-avg-sq-dtype`)."""

    optimizer_cpu_offload: bool = False
    """Step the first `optimizer_offload_fraction` of the main parameters, with their optimizer state, in host
    memory (`--optimizer-cpu-offload`, see cpu_offloading/); needs the precision-aware optimizer."""

    optimizer_offload_fraction: float = 1.0
    """Share of the main parameters' elements offloaded, whole tensors in parameter order
    (`--optimizer-offload-fraction`)."""

    overlap_cpu_optimizer_d2h_h2d: bool = False
    """Copy gradients to the host and parameters back on side streams, one host optimizer per parameter
    (`--overlap-cpu-optimizer-d2h-h2d`; on the CPU the copies are synchronous)."""

    use_torch_optimizer_for_cpu_offload: bool = False
    """Step the offloaded part with torch's multi-tensor AdamW (fp32 state) instead of the precision-aware
    AdamW (`--use-torch-optimizer-for-cpu-offload`)."""

    pin_cpu_grads: bool = True
    """Pin the offloaded parameters' host gradient buffers where the accelerator can use pinned memory."""

    pin_cpu_params: bool = True
    """Pin the offloaded parameters' host copies and their optimizer state likewise."""

    store_param_remainders: bool = True
    """Upstream's memory saving for bf16 parameters under the precision-aware optimizer with TE (main parameters
    kept as the 16 bits fp32 adds to bf16). Accepted for upstream's API: the main parameters here are whole fp32
    tensors, with the same values."""

    overlap_param_gather_with_optimizer_step: bool = False
    """Upstream's overlap of the parameter all-gather with the optimizer step (interleaved pipeline only); not
    implemented, as `--overlap-param-gather` already overlaps that all-gather with the next forward."""

    def __post_init__(self):
        if self.optimizer not in SUPPORTED_OPTIMIZERS:
            raise ValueError(f"OptimizerConfig.optimizer={self.optimizer!r}: choose one of {SUPPORTED_OPTIMIZERS}.")
        if self.lr is None or self.lr < 0:
            raise ValueError(f"OptimizerConfig.lr={self.lr!r}: set a non-negative peak learning rate (--lr).")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            raise ValueError(
                f"OptimizerConfig.min_lr={self.min_lr} must lie in [0, lr={self.lr}]: lower --min-lr or raise --lr."
            )
        if self.decoupled_min_lr is not None and self.decoupled_lr is None:
            raise ValueError("OptimizerConfig.decoupled_min_lr needs decoupled_lr: pass --decoupled-lr with "
                             "--decoupled-min-lr, or drop --decoupled-min-lr.")
        if self.decoupled_lr is not None and self.decoupled_lr < 0:
            raise ValueError(f"OptimizerConfig.decoupled_lr={self.decoupled_lr} must be >= 0 (--decoupled-lr).")
        if self.decoupled_min_lr is not None and not 0 <= self.decoupled_min_lr <= self.decoupled_lr:
            raise ValueError(f"OptimizerConfig.decoupled_min_lr={self.decoupled_min_lr} must lie in [0, "
                             f"decoupled_lr={self.decoupled_lr}] (--decoupled-min-lr, --decoupled-lr).")
        if self.fp16 and self.bf16:
            raise ValueError("OptimizerConfig: fp16 and bf16 are exclusive; pick one of --fp16 / --bf16.")
        if self.weight_decay < 0:
            raise ValueError(f"OptimizerConfig.weight_decay={self.weight_decay} must be >= 0.")
        for name in ("adam_beta1", "adam_beta2", "sgd_momentum"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ValueError(f"OptimizerConfig.{name}={value} must lie in [0, 1).")
        if self.adam_eps <= 0:
            raise ValueError(f"OptimizerConfig.adam_eps={self.adam_eps} must be > 0.")
        if self.clip_grad < 0:
            raise ValueError(f"OptimizerConfig.clip_grad={self.clip_grad} must be >= 0 (0 disables clipping).")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"OptimizerConfig.loss_scale={self.loss_scale} must be > 0, or None for dynamic scaling.")
        if not 0 < self.min_loss_scale <= self.initial_loss_scale:
            raise ValueError(
                f"OptimizerConfig: need 0 < min_loss_scale ({self.min_loss_scale}) <= initial_loss_scale "
                f"({self.initial_loss_scale})."
            )
        if self.loss_scale_window < 1:
            raise ValueError(f"OptimizerConfig.loss_scale_window={self.loss_scale_window} must be >= 1.")
        if self.hysteresis < 1:
            raise ValueError(f"OptimizerConfig.hysteresis={self.hysteresis} must be >= 1.")
        if self.overlap_param_gather_with_optimizer_step:
            raise ValueError(
                "OptimizerConfig.overlap_param_gather_with_optimizer_step (--overlap-param-gather-with-optimizer-step) "
                "is not implemented: with --overlap-param-gather the updated parameters' all-gather already overlaps "
                "the next forward; leave it False.")
        self._check_precision_aware()
        self._check_cpu_offload()
        self._check_muon()

    def _check_muon(self):
        if not 0 <= self.muon_momentum < 1:
            raise ValueError(f"OptimizerConfig.muon_momentum={self.muon_momentum} (--muon-momentum) must lie in "
                             "[0, 1).")
        if self.muon_num_ns_steps < 1:
            raise ValueError(f"OptimizerConfig.muon_num_ns_steps={self.muon_num_ns_steps} (--muon-num-ns-steps) must "
                             "be at least 1.")
        if self.muon_extra_scale_factor <= 0:
            raise ValueError(f"OptimizerConfig.muon_extra_scale_factor={self.muon_extra_scale_factor} "
                             "(--muon-extra-scale-factor) must be > 0.")
        for name, choices in (("muon_scale_mode", MUON_SCALE_MODES), ("muon_tp_mode", MUON_TP_MODES),
                              ("muon_fp32_matmul_prec", MUON_FP32_MATMUL_PRECISIONS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"OptimizerConfig.{name}={getattr(self, name)!r} (--{name.replace('_', '-')}): "
                                 f"choose one of {choices}.")

    def _check_cpu_offload(self):
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise ValueError(f"OptimizerConfig.optimizer_offload_fraction={self.optimizer_offload_fraction} "
                             "(--optimizer-offload-fraction) must lie in [0, 1].")
        if not self.optimizer_cpu_offload:
            for name in ("overlap_cpu_optimizer_d2h_h2d", "use_torch_optimizer_for_cpu_offload"):
                if getattr(self, name):
                    raise ValueError(f"OptimizerConfig.{name} (--{name.replace('_', '-')}) needs "
                                     "optimizer_cpu_offload=True (--optimizer-cpu-offload); pass it or drop the flag.")
            return
        if not self.use_precision_aware_optimizer:
            raise ValueError(
                "OptimizerConfig.optimizer_cpu_offload (--optimizer-cpu-offload) needs use_precision_aware_optimizer="
                "True (--use-precision-aware-optimizer, with --use-distributed-optimizer or --use-megatron-fsdp).")
        if self.use_torch_optimizer_for_cpu_offload:
            for name in ("main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
                if getattr(self, name) != torch.float32:
                    raise ValueError(
                        f"OptimizerConfig.use_torch_optimizer_for_cpu_offload (--use-torch-optimizer-for-cpu-offload) "
                        f"keeps fp32 state; drop --{name.replace('_', '-')} or that flag.")

    def _check_precision_aware(self):
        for name, allowed in PRECISION_AWARE_DTYPES.items():
            value = getattr(self, name)
            flag = "--" + name.replace("_", "-")
            if value not in allowed:
                raise ValueError(f"OptimizerConfig.{name}={value} ({flag}): choose one of {allowed}.")
            if value != torch.float32 and not self.use_precision_aware_optimizer:
                raise ValueError(
                    f"OptimizerConfig.{name}={value} ({flag}) needs use_precision_aware_optimizer=True "
                    "(--use-precision-aware-optimizer); drop it or pass that flag."
                )
        if not self.use_precision_aware_optimizer:
            return
        if self.optimizer != "adam":
            raise ValueError(
                "OptimizerConfig.use_precision_aware_optimizer (--use-precision-aware-optimizer) steps Adam only; "
                f"got optimizer={self.optimizer!r} (--optimizer adam)."
            )
        if not self.use_distributed_optimizer:
            raise ValueError(
                "OptimizerConfig.use_precision_aware_optimizer (--use-precision-aware-optimizer) needs the "
                "distributed optimizer: pass --use-distributed-optimizer (use_distributed_optimizer=True) or "
                "--use-megatron-fsdp."
            )

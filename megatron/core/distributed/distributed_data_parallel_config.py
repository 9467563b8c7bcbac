"""`DistributedDataParallelConfig`: how gradients are bucketed, reduced and (optionally) sharded."""

from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch

from megatron.core.model_parallel_config import refuse_assignment_naming_replace

DATA_PARALLEL_SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
MEGATRON_FSDP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUTER_DP_SHARDING_STRATEGIES = ("no_shard", "optim")


@partial(refuse_assignment_naming_replace, instance_name="ddp_config",
         reason=" (its rules are checked once, at construction)")
@dataclass(frozen=True)
class DistributedDataParallelConfig:
    """Settings of the data-parallel wrappers; `use_megatron_fsdp` / `use_torch_fsdp2` select the wrapper
    (see `megatron.core.distributed.wrap_data_parallel`). Validated at construction: every rule between these
    fields is checked here, once, and the wrappers rely on it; the messages name the command-line flags too.
    (Rules involving the model or its config, e.g. FSDP2's untied embeddings, are the wrappers' own.)"""

    grad_reduce_in_fp32: bool = False
    """Accumulate and reduce gradients in fp32 even when the parameters are bf16/fp16."""

    overlap_grad_reduce: bool = False
    """Start a bucket's reduction as soon as all its gradients are ready, overlapping the backward pass."""

    overlap_param_gather: bool = False
    """All-gather updated parameters (distributed optimizer) asynchronously, waiting per module in forward."""

    align_param_gather: bool = False
    """Issue all parameter all-gathers together, in one order on every rank. `DistributedDataParallel` always
    does so (right after the optimizer step), so the flag only matters to other data-parallel wrappers."""

    use_distributed_optimizer: bool = False
    """Reduce-scatter gradients and keep a flat parameter buffer so the optimizer can shard its state."""

    num_distributed_optimizer_instances: int = 1
    """>1: hybrid sharding, optimizer state sharded over DP/N ranks and replicated N times."""

    check_for_nan_in_grad: bool = False
    """Raise before communication if a bucket's local gradients hold inf/nan."""

    check_for_large_grads: bool = False
    """Before communication, hand each bucket's local gradient norm to the rerun state machine, which rejects (not
    fatally) a norm >= 10x the largest of the first 100 bucket norms (iteration 1 skipped), as upstream."""

    bucket_size: Optional[int] = None
    """Elements per bucket; None: one bucket per dtype, or max(40M, 1M * DP) with overlap_grad_reduce."""

    pad_buckets_for_high_nccl_busbw: bool = False
    """With `use_distributed_optimizer`: pad each bucket to a multiple of lcm(DP, 128, 2**16) elements instead of a
    multiple of DP, as upstream (no effect without it)."""

    reduce_scatter_with_fp32_accumulation: bool = False
    """With `use_distributed_optimizer` and gradients kept below fp32: reduce each bucket with fp32 accumulation
    (the bucket is widened to fp32 for the collective and the result rounded back), as upstream's reduce-scatter
    that accumulates locally in fp32; here the wire carries fp32."""

    average_in_collective: bool = False
    """Average with ReduceOp.AVG in the collective instead of pre-scaling gradients by 1/DP."""

    fp8_param_gather: bool = False
    """All-gather the FP8-region linear weights as FP8 (`--fp8-param-gather`): with the distributed optimizer,
    or with Megatron-FSDP under `optim_grads_params`."""

    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    """Upstream: all-gather MXFP8 parameters through the gradient buffer. MXFP8 needs Transformer Engine on GPUs,
    which this build does not use: only False is accepted."""

    gradient_reduce_div_fusion: bool = True
    """Upstream Megatron-FSDP: fuse the 1/DP division into the reduce-scatter (PREMUL_SUM). Gloo has no PREMUL_SUM,
    so gradients are scaled before the collective either way: the values are the same, True or False."""

    delay_wgrad_compute: bool = False
    """Upstream: delay weight-gradient GEMMs (Transformer Engine's split backward, CUDA). Only False is accepted
    here: weight gradients are computed inside each backward."""

    use_megatron_fsdp: bool = False
    """Wrap the model with Megatron-FSDP (`MegatronFSDPAdapter`, `--use-megatron-fsdp`) instead of Megatron
    DDP; `data_parallel_sharding_strategy` is its ZeRO level."""

    use_custom_fsdp: bool = False
    """Upstream's former name of `use_megatron_fsdp` (`--use-custom-fsdp`): True sets `use_megatron_fsdp`."""

    suggested_communication_unit_size: Optional[int] = None
    """Megatron-FSDP: elements per communication group outside the FSDP units (`--suggested-communication-unit-
    size`); it sets `bucket_size`, so give one or the other."""

    use_torch_fsdp2: bool = False
    """Wrap the model with PyTorch FSDP2 (`TorchFSDP2`, `--use-torch-fsdp2`) instead of Megatron DDP."""

    torch_fsdp2_reshard_after_forward: bool = True
    """FSDP2: free each unit's gathered parameters after its forward and gather them again for backward (True),
    or keep them until backward (False, `--torch-fsdp2-no-reshard-after-forward`)."""

    torch_fsdp2_cpu_offload: bool = False
    """FSDP2: keep the sharded parameters and their gradient shards in (pinned) host memory through torch's
    `CPUOffloadPolicy`, so the optimizer steps there; each unit's all-gather copies its shards to the device
    (`--torch-fsdp2-cpu-offload`)."""

    data_parallel_sharding_strategy: str = "no_shard"
    """Megatron-FSDP ZeRO level: no_shard | optim | optim_grads | optim_grads_params."""

    outer_dp_sharding_strategy: str = "no_shard"
    """Megatron-FSDP across the outer DP dimension: no_shard (HSDP) | optim (HFSDP)."""

    fsdp_double_buffer: bool = False
    """Megatron-FSDP ZeRO-3: gather units into a fixed pool of two unit-sized buffers."""

    fsdp_db_use_persist_buf_on_alloc_fail: bool = False
    """Megatron-FSDP with `fsdp_double_buffer`: if the pool does not fit in memory, each parameter group gets a
    gather buffer of its own instead of failing (`--fsdp-db-use-persist-buf-on-alloc-fail`)."""

    nccl_ub: bool = False
    """Megatron-FSDP: allocate its buffers from a memory pool registered with NCCL (NCCL user buffers,
    `--use-nccl-ub`; see `megatron_fsdp.nccl_allocator`)."""

    fsdp_manual_registration: bool = False
    """With `nccl_ub`: register the pool once, after every buffer exists (`--fsdp-manual-registration`)."""

    disable_symmetric_registration: bool = False
    """With `nccl_ub`: local instead of symmetric (window) registration (`--disable-symmetric-registration`)."""

    megatron_fsdp_main_params_dtype: Optional[torch.dtype] = torch.float32
    """Megatron-FSDP: dtype of the sharded main weights the optimizer steps on; None ("auto") keeps the
    parameters' own dtype (`--megatron-fsdp-main-params-dtype`)."""

    megatron_fsdp_main_grads_dtype: Optional[torch.dtype] = None
    """Megatron-FSDP: dtype gradients accumulate in and reach the optimizer with; None ("auto"): fp32 with
    `grad_reduce_in_fp32`, otherwise the parameters' dtype, as Megatron DDP keeps its gradients
    (`--megatron-fsdp-main-grads-dtype`)."""

    megatron_fsdp_grad_comm_dtype: Optional[torch.dtype] = None
    """Megatron-FSDP: dtype gradients are reduced in; None ("auto"): the main grads dtype
    (`--megatron-fsdp-grad-comm-dtype`)."""

    megatron_fsdp_param_offload: bool = False
    """Megatron-FSDP ZeRO-3: keep the parameter shards, main weights and gradient shards in (pinned) host memory,
    copied to the device for each unit's gather; the optimizer steps on the host (`--megatron-fsdp-param-offload`)."""

    preproc_state_dict_for_dcp_ckpt: bool = True
    """Megatron-FSDP: state dicts hold DTensors that torch.distributed.checkpoint can reshard."""

    preserve_fp32_weights: bool = True
    """Megatron-FSDP (upstream's name): keep fp32 main weights. False with the default fp32
    `megatron_fsdp_main_params_dtype` sets it to None, the parameters' own dtype (`--megatron-fsdp-main-params-dtype
    auto`)."""

    keep_fp8_transpose_cache: bool = False
    """FP8 linear layers of the wrapped model keep the FP8 transpose of their weight (made in the weight's quantize
    pass) for the backward GEMM, as `TransformerConfig.keep_fp8_transpose_cache` / `--keep-fp8-transpose-cache`
    does; the wrapper turns it on in the layers."""

    @property
    def wrapper_name(self) -> str:
        """The data-parallel wrapper these settings select: "ddp", "megatron_fsdp" or "torch_fsdp2"."""
        if self.use_megatron_fsdp:
            return "megatron_fsdp"
        return "torch_fsdp2" if self.use_torch_fsdp2 else "ddp"

    def __post_init__(self):
        if self.use_custom_fsdp:
            object.__setattr__(self, "use_megatron_fsdp", True)
        self._apply_communication_unit_size()
        self._check_fp32_accumulation()
        if not self.preserve_fp32_weights and self.megatron_fsdp_main_params_dtype == torch.float32:
            object.__setattr__(self, "megatron_fsdp_main_params_dtype", None)
        if self.megatron_fsdp_param_offload and not (
                self.use_megatron_fsdp and self.data_parallel_sharding_strategy == "optim_grads_params"):
            raise ValueError(
                "DistributedDataParallelConfig.megatron_fsdp_param_offload (--megatron-fsdp-param-offload) offloads "
                "ZeRO-3's shards: it needs use_megatron_fsdp=True (--use-megatron-fsdp) with "
                "data_parallel_sharding_strategy='optim_grads_params'."
            )
        if self.nccl_ub and not self.use_megatron_fsdp:
            raise ValueError(
                "DistributedDataParallelConfig.nccl_ub (--use-nccl-ub) registers Megatron-FSDP's buffers with NCCL: it "
                "needs use_megatron_fsdp=True (--use-megatron-fsdp)."
            )
        for name, flag in (("fsdp_manual_registration", "--fsdp-manual-registration"),
                           ("disable_symmetric_registration", "--disable-symmetric-registration")):
            if getattr(self, name) and not self.nccl_ub:
                raise ValueError(f"DistributedDataParallelConfig.{name} ({flag}) needs nccl_ub=True (--use-nccl-ub).")
        if self.fsdp_db_use_persist_buf_on_alloc_fail and not self.fsdp_double_buffer:
            raise ValueError(
                "DistributedDataParallelConfig.fsdp_db_use_persist_buf_on_alloc_fail (--fsdp-db-use-persist-buf-on-"
                "alloc-fail) is the fallback of fsdp_double_buffer=True (--fsdp-double-buffer): set both or neither."
            )
        if self.torch_fsdp2_cpu_offload and not self.use_torch_fsdp2:
            raise ValueError(
                "DistributedDataParallelConfig.torch_fsdp2_cpu_offload (--torch-fsdp2-cpu-offload) offloads FSDP2's "
                "shards: it needs use_torch_fsdp2=True (--use-torch-fsdp2)."
            )
        if self.overlap_param_gather and not (self.use_distributed_optimizer or self.use_megatron_fsdp):
            raise ValueError(
                "DistributedDataParallelConfig.overlap_param_gather needs a sharded optimizer: set "
                "use_distributed_optimizer=True (--use-distributed-optimizer) or use_megatron_fsdp=True."
            )
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            raise ValueError(
                "DistributedDataParallelConfig.overlap_param_gather needs overlap_grad_reduce=True "
                "(--overlap-grad-reduce)."
            )
        if self.bucket_size is not None and self.bucket_size <= 0:
            raise ValueError(
                f"DistributedDataParallelConfig.bucket_size={self.bucket_size} must be positive, "
                "or None for the default."
            )
        if self.num_distributed_optimizer_instances < 1:
            raise ValueError(
                "DistributedDataParallelConfig.num_distributed_optimizer_instances="
                f"{self.num_distributed_optimizer_instances} must be >= 1."
            )
        if self.num_distributed_optimizer_instances > 1 and not (
            self.use_distributed_optimizer or self.use_megatron_fsdp
        ):
            raise ValueError(
                "DistributedDataParallelConfig.num_distributed_optimizer_instances > 1 needs "
                "use_distributed_optimizer=True or use_megatron_fsdp=True."
            )
        if self.data_parallel_sharding_strategy not in DATA_PARALLEL_SHARDING_STRATEGIES:
            raise ValueError(
                f"DistributedDataParallelConfig.data_parallel_sharding_strategy="
                f"{self.data_parallel_sharding_strategy!r}: choose one of {DATA_PARALLEL_SHARDING_STRATEGIES}."
            )
        if self.outer_dp_sharding_strategy not in OUTER_DP_SHARDING_STRATEGIES:
            raise ValueError(
                f"DistributedDataParallelConfig.outer_dp_sharding_strategy={self.outer_dp_sharding_strategy!r}: "
                f"choose one of {OUTER_DP_SHARDING_STRATEGIES}."
            )
        for name in ("megatron_fsdp_main_params_dtype", "megatron_fsdp_main_grads_dtype",
                     "megatron_fsdp_grad_comm_dtype"):
            value = getattr(self, name)
            if value is not None and value not in MEGATRON_FSDP_DTYPES:
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"DistributedDataParallelConfig.{name}={value} ({flag}): choose torch.float32, torch.bfloat16, "
                    "torch.float16 or None (auto)."
                )
        if self.fsdp_double_buffer and not (
            self.use_megatron_fsdp and self.data_parallel_sharding_strategy == "optim_grads_params"
        ):
            raise ValueError(
                "DistributedDataParallelConfig.fsdp_double_buffer (--fsdp-double-buffer) needs use_megatron_fsdp=True "
                "with data_parallel_sharding_strategy='optim_grads_params'."
            )
        if self.outer_dp_sharding_strategy == "optim" and self.use_megatron_fsdp and (
            self.data_parallel_sharding_strategy != "optim_grads_params"
        ):
            raise ValueError(
                "DistributedDataParallelConfig.outer_dp_sharding_strategy='optim' (HFSDP) needs "
                "data_parallel_sharding_strategy='optim_grads_params'."
            )
        if self.reuse_grad_buf_for_mxfp8_param_ag:
            raise ValueError(
                "DistributedDataParallelConfig.reuse_grad_buf_for_mxfp8_param_ag (--reuse-grad-buf-for-mxfp8-param-ag) "
                "all-gathers MXFP8 parameters, and MXFP8 (--fp8-recipe mxfp8) needs Transformer Engine on GPUs, which "
                "this build does not use: drop it (FP8 weights are gathered with --fp8-param-gather and --fp8-recipe "
                "delayed or tensorwise)."
            )
        if self.delay_wgrad_compute:
            raise ValueError(
                "DistributedDataParallelConfig.delay_wgrad_compute (--delay-wgrad-compute) needs Transformer Engine's "
                "split weight-gradient GEMMs (CUDA), which this build does not use: weight gradients are computed "
                "inside each backward; drop it (the values are the same)."
            )
        self._check_wrapper_choice()
        self._check_fp8_param_gather()

    def _apply_communication_unit_size(self):
        unit = self.suggested_communication_unit_size
        if unit is None:
            return
        if not self.use_megatron_fsdp:
            raise ValueError("DistributedDataParallelConfig.suggested_communication_unit_size (--suggested-"
                             "communication-unit-size) needs use_megatron_fsdp=True (--use-megatron-fsdp).")
        if unit <= 0:
            raise ValueError(f"DistributedDataParallelConfig.suggested_communication_unit_size={unit} must be "
                             "positive.")
        if self.bucket_size is not None and self.bucket_size != unit:
            raise ValueError("DistributedDataParallelConfig.suggested_communication_unit_size sets Megatron-FSDP's "
                             "bucket_size: give one of them, not both.")
        object.__setattr__(self, "bucket_size", unit)

    def _check_fp32_accumulation(self):
        if self.reduce_scatter_with_fp32_accumulation and (
                not self.use_distributed_optimizer or self.use_megatron_fsdp or self.use_torch_fsdp2):
            raise ValueError(
                "DistributedDataParallelConfig.reduce_scatter_with_fp32_accumulation is the reduce-scatter of Megatron "
                "DDP's distributed optimizer: it needs use_distributed_optimizer=True (--use-distributed-optimizer) "
                "without use_megatron_fsdp / use_torch_fsdp2 (Megatron-FSDP: set megatron_fsdp_grad_comm_dtype="
                "torch.float32; or reduce in fp32 everywhere with grad_reduce_in_fp32=True)."
            )

    def _check_wrapper_choice(self):
        if self.use_megatron_fsdp and self.use_torch_fsdp2:
            raise ValueError(
                "DistributedDataParallelConfig: use_megatron_fsdp and use_torch_fsdp2 (--use-megatron-fsdp and "
                "--use-torch-fsdp2 are exclusive): pick one."
            )
        # Per-bucket checks before communication: Megatron DDP's (and, for NaN/Inf, Megatron-FSDP's) own.
        unchecked = [name for name, wrapper_checks in (
            ("check_for_large_grads", self.wrapper_name == "ddp"),
            ("check_for_nan_in_grad", self.wrapper_name != "torch_fsdp2"),
        ) if getattr(self, name) and not wrapper_checks]
        if unchecked:
            raise ValueError(
                f"DistributedDataParallelConfig.{unchecked[0]}: the {self.wrapper_name} wrapper does not check its "
                "gradients per bucket; drop it (the training loop checks the gradients of every wrapper: "
                "--check-for-large-grads, and NaN/Inf unless --no-check-for-nan-in-loss-and-grad)."
            )
        if self.use_torch_fsdp2 and self.use_distributed_optimizer:
            raise ValueError(
                "DistributedDataParallelConfig: use_torch_fsdp2 with use_distributed_optimizer (--use-torch-fsdp2 "
                "and --use-distributed-optimizer are exclusive): FSDP2 shards optimizer state itself; drop "
                "--use-distributed-optimizer."
            )

    def _check_fp8_param_gather(self):
        if not self.fp8_param_gather:
            return
        if not (self.use_distributed_optimizer or self.use_megatron_fsdp):
            raise ValueError(
                "DistributedDataParallelConfig.fp8_param_gather: --fp8-param-gather needs "
                "--use-distributed-optimizer (use_distributed_optimizer=True) or --use-megatron-fsdp."
            )
        if not self.use_megatron_fsdp:
            return
        if self.data_parallel_sharding_strategy != "optim_grads_params":
            raise ValueError(
                "DistributedDataParallelConfig.fp8_param_gather: --fp8-param-gather with --use-megatron-fsdp needs "
                "--data-parallel-sharding-strategy optim_grads_params "
                f"(got {self.data_parallel_sharding_strategy}): only ZeRO-3 all-gathers the compute weights each "
                "step; the other strategies keep full compute weights (drop --fp8-param-gather, or use strategy "
                "optim_grads_params)."
            )
        if self.num_distributed_optimizer_instances > 1 and self.outer_dp_sharding_strategy != "no_shard":
            raise ValueError(
                "DistributedDataParallelConfig.fp8_param_gather: --fp8-param-gather with --use-megatron-fsdp does "
                "not support --outer-dp-sharding-strategy optim (HFSDP); use --outer-dp-sharding-strategy no_shard "
                "(HSDP) or a single optimizer instance."
            )

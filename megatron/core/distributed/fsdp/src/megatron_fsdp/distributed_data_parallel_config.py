"""Configuration of data-parallel training under Megatron-FSDP, validated once when it is built."""

import enum
from dataclasses import dataclass
from typing import Union


class ShardingStrategy(enum.IntEnum):
    """ZeRO level: what is sharded across the data-parallel ranks."""

    no_shard = 0  # nothing: DDP-like all-reduce of gradients
    optim = 1  # main weights and optimizer state
    optim_grads = 2  # ... plus gradients
    optim_grads_params = 3  # ... plus the compute weights

    @classmethod
    def parse(cls, value: Union[str, int, "ShardingStrategy"], flag: str = "zero_dp_strategy") -> "ShardingStrategy":
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            if value in cls.__members__:
                return cls[value]
            if value.isdigit():
                value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and value in {s.value for s in cls}:
            return cls(value)
        choices = ", ".join(f"{s.name} ({s.value})" for s in cls)
        raise ValueError(f"{flag}={value!r} is not a sharding strategy; choose one of {choices}")


@dataclass(frozen=True)
class DistributedDataParallelConfig:
    """Data-parallel options shared by Megatron-FSDP and Megatron-Core's DDP.

    `data_parallel_sharding_strategy` and `outer_dp_sharding_strategy` accept names or ZeRO levels and are
    normalised to `ShardingStrategy`. `bucket_size` caps (in elements) the groups of parameters that live
    outside any FSDP unit; None picks a default that scales with the data-parallel size.

    `grad_reduce_in_fp32=True` reduces gradients in fp32 whatever the MixedPrecisionPolicy says (an explicit
    non-fp32 `grad_comm_dtype` is an error); False leaves it to the policy, which already reduces and accumulates
    in fp32 when the main weights are fp32. `num_distributed_optimizer_instances` is Megatron's name for the outer
    replicas. `check_for_nan_in_grad` is `report_nan_in_param_grad`. `use_distributed_optimizer` and
    `use_megatron_fsdp` are shared with Megatron-Core's DDP config; Megatron-FSDP always shards the optimizer, so
    they are informational here.

    Only rules between the flags themselves are checked here. Rules that depend on how the ranks are arranged
    (HFSDP needs an outer dim and strategy 3, the number of optimizer instances equals the outer size) are
    checked by `DataParallelTopology` (topology.py), which sees the mesh.
    """

    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    use_distributed_optimizer: bool = False
    use_megatron_fsdp: bool = False
    data_parallel_sharding_strategy: Union[str, int, ShardingStrategy] = "no_shard"
    outer_dp_sharding_strategy: Union[str, int, ShardingStrategy] = "no_shard"
    num_distributed_optimizer_instances: int = 1
    check_for_nan_in_grad: bool = False
    bucket_size: Union[int, None] = None
    average_in_collective: bool = False
    fsdp_double_buffer: bool = False
    # With fsdp_double_buffer: if the pool's allocation runs out of memory, each group gets a buffer of its own.
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False
    preproc_state_dict_for_dcp_ckpt: bool = True
    param_offload: bool = False  # ZeRO-3's shard buffers (weights, main weights, gradients) in host memory

    def __post_init__(self):
        strategy = ShardingStrategy.parse(self.data_parallel_sharding_strategy, "data_parallel_sharding_strategy")
        outer = ShardingStrategy.parse(self.outer_dp_sharding_strategy, "outer_dp_sharding_strategy")
        object.__setattr__(self, "data_parallel_sharding_strategy", strategy)
        object.__setattr__(self, "outer_dp_sharding_strategy", outer)
        if outer not in (ShardingStrategy.no_shard, ShardingStrategy.optim):
            raise ValueError(
                f"outer_dp_sharding_strategy={outer.name} is not supported; use 'no_shard' (HSDP) or 'optim' (HFSDP)"
            )
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            raise ValueError("overlap_param_gather=True needs overlap_grad_reduce=True; enable both or neither")
        if self.fsdp_double_buffer and strategy != ShardingStrategy.optim_grads_params:
            raise ValueError(
                "fsdp_double_buffer=True only applies to data_parallel_sharding_strategy='optim_grads_params'"
            )
        if self.fsdp_db_use_persist_buf_on_alloc_fail and not self.fsdp_double_buffer:
            raise ValueError("fsdp_db_use_persist_buf_on_alloc_fail=True is the fallback of fsdp_double_buffer=True; "
                             "set fsdp_double_buffer=True or drop it")
        if self.param_offload and strategy != ShardingStrategy.optim_grads_params:
            raise ValueError(
                "param_offload=True keeps ZeRO-3's parameter shards in host memory: it needs "
                "data_parallel_sharding_strategy='optim_grads_params'"
            )
        if self.num_distributed_optimizer_instances < 1:
            raise ValueError("num_distributed_optimizer_instances must be >= 1")
        if self.bucket_size is not None and self.bucket_size < 0:
            raise ValueError(f"bucket_size={self.bucket_size} must be >= 0 (0 disables bucketing)")

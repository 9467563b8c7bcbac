"""Megatron-FSDP: fully sharded data parallelism (ZeRO-0..3) that runs on CPU (gloo) and GPU (NCCL)."""

from . import package_info
from .distributed_data_parallel_config import DistributedDataParallelConfig, ShardingStrategy
from .gather_codec import GatherCodec, GatherCodecPolicy
from .fully_shard import fully_shard, fully_shard_model, fully_shard_optimizer
from .megatron_fsdp import MegatronFSDP
from .mixed_precision import MixedPrecisionPolicy
from .nccl_allocator import NcclUserBuffers
from .optimizer import clip_grad_norm_
from .package_info import __version__

__all__ = [
    "fully_shard_model",
    "fully_shard_optimizer",
    "fully_shard",
    "MegatronFSDP",
    "MixedPrecisionPolicy",
    "NcclUserBuffers",
    "GatherCodec",
    "GatherCodecPolicy",
    "DistributedDataParallelConfig",
    "ShardingStrategy",
    "clip_grad_norm_",
    "package_info",
]

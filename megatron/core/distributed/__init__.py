"""Data parallelism for Megatron-Core models: DDP with bucketed gradient buffers, Megatron-FSDP (ZeRO-0..3,
`FullyShardedDataParallel`), and gradient finalisation."""

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.distributed.param_and_grad_buffer import BucketCommunicationGroups

__all__ = [
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "FullyShardedDataParallel",
    "BucketCommunicationGroups",
    "finalize_model_grads",
]

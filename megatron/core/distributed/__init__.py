"""Data parallelism for Megatron-Core models, behind one contract (`DataParallelWrapper`):

- `DistributedDataParallel`: Megatron DDP with bucketed gradient buffers (and the distributed optimizer's layout);
- `MegatronFSDPAdapter`: Megatron-FSDP, ZeRO-0..3 (upstream name `FullyShardedDataParallel`);
- `TorchFSDP2`: PyTorch FSDP2 (upstream name `TorchFullyShardedDataParallel`).

`wrap_data_parallel(config, ddp_config, module)` picks one from `DistributedDataParallelConfig`;
`finalize_model_grads` finishes gradients after the last backward; `unwrap_model` strips the wrappers.
"""

from megatron.core.distributed.data_parallel_base import DataParallelWrapper, local_tensor, unwrap_model
from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel, MegatronFSDPAdapter
from megatron.core.distributed.param_and_grad_buffer import BucketCommunicationGroups
from megatron.core.distributed.wrapper_factory import data_parallel_wrapper_class, wrap_data_parallel

_LAZY = {  # FSDP2 imports torch.distributed.fsdp on first use only
    "TorchFSDP2": "torch_fully_sharded_data_parallel",
    "TorchFullyShardedDataParallel": "torch_fully_sharded_data_parallel",
}

__all__ = [
    "DataParallelWrapper",
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "MegatronFSDPAdapter",
    "FullyShardedDataParallel",
    "TorchFSDP2",
    "TorchFullyShardedDataParallel",
    "BucketCommunicationGroups",
    "data_parallel_wrapper_class",
    "wrap_data_parallel",
    "finalize_model_grads",
    "local_tensor",
    "unwrap_model",
]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

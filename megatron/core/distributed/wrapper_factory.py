"""`wrap_data_parallel`: the one place a model chunk's data-parallel wrapper is chosen, from its config."""

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig


def data_parallel_wrapper_class(ddp_config: DistributedDataParallelConfig) -> type:
    """The `DataParallelWrapper` subclass `ddp_config` selects: `MegatronFSDPAdapter` with `use_megatron_fsdp`,
    `TorchFSDP2` with `use_torch_fsdp2`, Megatron's `DistributedDataParallel` otherwise (also for the
    distributed optimizer, `use_distributed_optimizer`, which steps on DDP's buffers)."""
    if ddp_config.wrapper_name == "megatron_fsdp":
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import MegatronFSDPAdapter

        return MegatronFSDPAdapter
    if ddp_config.wrapper_name == "torch_fsdp2":
        from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFSDP2

        return TorchFSDP2
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel

    return DistributedDataParallel


def wrap_data_parallel(config, ddp_config: DistributedDataParallelConfig, module):
    """`module` (one pipeline stage's model chunk, with model config `config`) wrapped as `ddp_config` selects."""
    wrapper_class = data_parallel_wrapper_class(ddp_config)
    return wrapper_class(config=config, ddp_config=ddp_config, module=module)

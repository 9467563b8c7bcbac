"""Megatron-FSDP inside Megatron-Core: `MegatronFSDPAdapter` wraps a model chunk with the `megatron_fsdp` package
(upstream name `FullyShardedDataParallel`)."""

from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel, MegatronFSDPAdapter
from megatron.core.distributed.fsdp_units import default_fsdp_unit_modules

__all__ = ["MegatronFSDPAdapter", "FullyShardedDataParallel", "default_fsdp_unit_modules"]

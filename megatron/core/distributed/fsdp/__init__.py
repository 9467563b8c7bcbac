"""Megatron-FSDP inside Megatron-Core: the adapter that wraps a model chunk with the `megatron_fsdp` package."""

from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel, default_fsdp_unit_modules

__all__ = ["FullyShardedDataParallel", "default_fsdp_unit_modules"]

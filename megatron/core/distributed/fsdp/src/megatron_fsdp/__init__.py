"""Megatron-FSDP: fully sharded data parallelism (ZeRO-0..3) that runs on CPU (gloo) and GPU (NCCL).

The public names below are loaded on first use: importing one submodule (`megatron_fsdp.collectives`, say) does
not import the rest of the package, nor torch.distributed.tensor, which are slow to import.
"""

import importlib
import sys
import types

from . import package_info

__version__ = package_info.__version__

_EXPORTS = {
    "fully_shard_model": ".fully_shard",
    "fully_shard_optimizer": ".fully_shard",
    "fully_shard": ".fully_shard",
    "MegatronFSDP": ".megatron_fsdp",
    "FSDPDistributedIndex": ".distributed_index",
    "MixedPrecisionPolicy": ".mixed_precision",
    "NcclUserBuffers": ".nccl_allocator",
    "GatherCodec": ".gather_codec",
    "GatherCodecPolicy": ".gather_codec",
    "DistributedDataParallelConfig": ".distributed_data_parallel_config",
    "ShardingStrategy": ".distributed_data_parallel_config",
    "clip_grad_norm_": ".optimizer",
}

__all__ = list(_EXPORTS) + ["package_info"]


def __getattr__(name):
    """A public name, loaded from its submodule; or a submodule not yet imported (`megatron_fsdp.utils`)."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


class _Package(types.ModuleType):
    """Keeps `megatron_fsdp.fully_shard` the function: importing the submodule of that name sets the package
    attribute to the submodule."""

    def __setattr__(self, name, value):
        if name == "fully_shard" and isinstance(value, types.ModuleType):
            value = value.fully_shard
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

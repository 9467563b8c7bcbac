"""Distributed checkpoints in one logical format (`--ckpt-format torch_dist` / `torch_dcp` / `fsdp_dtensor`).

Every tensor is saved under its name in the unsplit, single-rank model with its full shape; what a rank holds
(a tensor-parallel partition, a distributed-optimizer or FSDP shard, a pipeline stage's layers) is a set of
boxes of it. torch.distributed.checkpoint writes the boxes and reads any overlap back, so a checkpoint written
at one layout and wrapper loads at any other.

- `logical_tensor`: boxes of a logical tensor (`ShardedLogicalTensor`, flat ranges -> boxes, DTensor shards)
- `model_state`: logical names and placements of model tensors (DDP and FSDP2 chunks)
- `optimizer_state`: main parameters and moments keyed by logical name (FP32, mixed-precision, distributed)
- `fsdp_state`: the same for Megatron-FSDP chunks (from its name-keyed DTensor state dicts)
- `wrappers`: picks one of the above per wrapper
- `first_step_state`: optimizer state torch creates on the first step (SGD's momentum), asked for when loading
- `planners`, `serialization`: DCP save / load with errors naming files and tensors
- `strictness`: `--dist-ckpt-strictness`
- `vocab_padding`: word embedding and output layer loaded across another vocabulary padding (another TP size)
- `fp8_histories`: FP8 amax histories loaded across another `--fp8-amax-history-len`
- `rng_mapping`: which saved rank's random-number streams a rank of another layout restores
- `offline`, `safetensors_format`: whole-tensor reads and writes for tools, without a process group
- `api` (`save`, `load`, `load_common_state_dict`), `mapping` (`ShardedTensor`, `ShardedObject`), `strategies`,
  `validation`, `utils`: upstream's entry points and names over the same format
- `inspection` (`check_is_distributed_checkpoint`, `load_tensors_metadata`, `load_sharded_metadata`,
  `load_plain_tensors`, `load_content_metadata`, `remove_sharded_tensors`): upstream's reads (and pruning) of a
  checkpoint without a model
- `dict_utils` (`dict_list_map_inplace`, ...), `strategies.fully_parallel`: upstream's helpers and wrappers
- `access_integrity`: `save(..., validate_access_integrity=True)`, the ranks' ShardedTensors must tile each tensor
"""

from megatron.core.dist_checkpointing.strictness import STRICTNESS_CHOICES, StrictHandling

_LAZY = {  # torch.distributed.checkpoint is imported on first use, not by argument parsing
    "ShardedLogicalTensor": "logical_tensor",
    "flat_range_boxes": "logical_tensor",
    "CheckpointError": "serialization",
    "CheckpointShapeError": "serialization",
    "save": "api",
    "load": "api",
    "load_common_state_dict": "api",
    "ShardedTensor": "mapping",
    "ShardedObject": "mapping",
    "check_is_distributed_checkpoint": "inspection",
    "load_tensors_metadata": "inspection",
    "load_plain_tensors": "inspection",
    "load_content_metadata": "inspection",
    "load_sharded_metadata": "inspection",
    "remove_sharded_tensors": "inspection",
    "ShardedTensorFactory": "mapping",
    "LocalNonpersistentObject": "mapping",
    "get_default_save_sharded_strategy": "serialization",
    "get_default_load_sharded_strategy": "serialization",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Upstream's names for the shapes of (sharded) state dicts.

A sharded state dict maps checkpoint keys to `ShardedLogicalTensor`s (a rank's pieces of a logical tensor),
DTensors, plain tensors (saved whole) or picklable objects; see `serialization`.
"""

from typing import Any, Dict

from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor

StateDict = Dict[str, Any]
ShardedStateDict = Dict[str, Any]

__all__ = ["ShardedLogicalTensor", "ShardedStateDict", "StateDict"]

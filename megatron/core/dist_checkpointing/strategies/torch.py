"""The torch_dist strategies: torch.distributed.checkpoint writes and reads the logical checkpoint (defined in
`serialization`, next to the reads and writes they call)."""

from megatron.core.dist_checkpointing.serialization import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)

__all__ = ["TorchDistLoadShardedStrategy", "TorchDistSaveShardedStrategy", "get_default_load_sharded_strategy",
           "get_default_save_sharded_strategy"]

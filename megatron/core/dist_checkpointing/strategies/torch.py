"""The torch_dist strategies: torch.distributed.checkpoint writes and reads the logical checkpoint."""

from megatron.core.dist_checkpointing import serialization


class TorchDistSaveShardedStrategy:
    """Writes a sharded state dict with `serialization.save` (collective over `process_group`)."""

    backend = "torch_dist"

    def __init__(self, backend="torch_dist", version=1, thread_count=1, process_group=None):
        if backend != "torch_dist":
            raise ValueError(f"TorchDistSaveShardedStrategy writes the torch_dist format, not {backend!r}")
        self.thread_count = thread_count
        self.process_group = process_group

    def save(self, sharded_state_dict, checkpoint_dir):
        serialization.save(sharded_state_dict, str(checkpoint_dir), self.process_group,
                           thread_count=self.thread_count)


class TorchDistLoadShardedStrategy:
    """Fills a sharded state dict in place with `serialization.load` (collective) and returns it."""

    def __init__(self, process_group=None):
        self.process_group = process_group

    def load(self, sharded_state_dict, checkpoint_dir):
        return serialization.load(sharded_state_dict, str(checkpoint_dir), self.process_group)

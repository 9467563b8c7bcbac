"""DCP planners that also accept `ShardedLogicalTensor` values (several pieces of one logical tensor).

State dicts here are flat (`{key: value}`): a nested object such as a scheduler's state dict is one pickled
item, not flattened into keys, so it comes back whole.
"""

from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor


def _lookup(state_dict, index, default_lookup):
    value = state_dict.get(index.fqn)
    if isinstance(value, ShardedLogicalTensor):
        return value.piece_at(index.offset)
    return default_lookup(index)


class LogicalSavePlanner(DefaultSavePlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index):
        return _lookup(self.state_dict, index, super().lookup_object)


class LogicalLoadPlanner(DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        logical = {key: value for key, value in state_dict.items() if isinstance(value, ShardedLogicalTensor)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(logical)  # DCP's meta-device pass replaces types it does not know with None

    def lookup_tensor(self, index):
        return _lookup(self.state_dict, index, super().lookup_tensor)

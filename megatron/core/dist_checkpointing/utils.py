"""Helpers over sharded state dicts (upstream names)."""

from megatron.core.dist_checkpointing.mapping import ShardedStateDict


def replace_prefix_for_sharding(sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str) -> None:
    """Rename, in place, every checkpoint key `old_prefix + rest` of `sharded_state_dict` (nested dicts under a
    key are entered) to `new_prefix + rest`. A key without `old_prefix` is a ValueError naming it."""
    renamed = {}
    for key in list(sharded_state_dict):
        value = sharded_state_dict.pop(key)
        if not key.startswith(old_prefix):
            sharded_state_dict[key] = value
            sharded_state_dict.update(renamed)
            raise ValueError(f"sharded state dict key '{key}' does not start with the prefix '{old_prefix}'")
        if isinstance(value, dict):
            replace_prefix_for_sharding(value, old_prefix, new_prefix)
        renamed[new_prefix + key[len(old_prefix):]] = value
    sharded_state_dict.update(renamed)

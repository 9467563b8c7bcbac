"""Minitron width pruning of a GPTModel on any device (hidden size, FFN size, attention heads), without modelopt:
`collect_width_importance` scores the channels on calibration batches, `select_kept_channels` picks the most
important ones for target sizes, `prune_gpt_width` builds the smaller model with their weights."""

from megatron.core.post_training.prune.importance import WidthImportance, check_prunable, collect_width_importance
from megatron.core.post_training.prune.width_pruning import (
    KeptChannels,
    WidthPruningTarget,
    build_like,
    copy_kept_weights,
    prune_gpt_width,
    pruned_config,
    select_kept_channels,
)

__all__ = [
    "KeptChannels", "WidthImportance", "WidthPruningTarget", "build_like", "check_prunable",
    "collect_width_importance", "copy_kept_weights", "prune_gpt_width", "pruned_config", "select_kept_channels",
]

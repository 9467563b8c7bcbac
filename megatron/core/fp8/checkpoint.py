"""FP8 state in checkpoints: loading a checkpoint without FP8 amax histories into an FP8 run.

Under delayed scaling each FP8 linear layer keeps its amax histories in buffers (`fp8_amax_history`,
`fp8_amax_recorded_count`), so checkpoints of FP8 runs carry them. A checkpoint of a run without FP8 (or with
another recipe) has none, and loading it into a delayed-scaling model is a normal thing to do (fine-tuning in
FP8): the histories then start empty, as in a fresh run (the first step scales by the current amax), and the
load says so instead of failing on the missing buffers.
"""

from typing import List, Sequence, Tuple

import torch

FP8_HISTORY_BUFFERS = ("fp8_amax_history", "fp8_amax_recorded_count")


def is_fp8_history_key(key: str) -> bool:
    """Whether a state-dict key (any prefix) names an FP8 amax-history buffer."""
    return key.rsplit(".", 1)[-1] in FP8_HISTORY_BUFFERS


def start_missing_fp8_histories_empty(module, state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs):
    """`load_state_dict` pre-hook of an FP8 linear layer: a state dict without its amax-history buffers (from a
    run without delayed FP8 scaling) loads, and the histories start empty."""
    # Only a state dict without any of them is from a run without the histories; one without just one of them
    # is left to the usual missing-key error.
    if any(prefix + name in state_dict for name in FP8_HISTORY_BUFFERS):
        return
    if not all(getattr(module, name, None) is not None for name in FP8_HISTORY_BUFFERS):
        return
    for name in FP8_HISTORY_BUFFERS:
        state_dict[prefix + name] = torch.zeros_like(getattr(module, name))
    module.fp8_histories_started_empty = True


def count_fp8_histories_started_empty(model_chunks: Sequence[torch.nn.Module]) -> int:
    """Layers whose amax histories the last load started empty (and forget it, so a later load counts anew)."""
    count = 0
    for chunk in model_chunks:
        for module in chunk.modules():
            if module.__dict__.pop("fp8_histories_started_empty", False):
                count += 1
    return count


def split_missing_fp8_histories(missing_keys: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(other missing keys, missing FP8 history keys): the latter are not an error, they start empty."""
    histories = [key for key in missing_keys if is_fp8_history_key(key)]
    return [key for key in missing_keys if not is_fp8_history_key(key)], histories


def fp8_histories_report(history_keys: Sequence[str]) -> str:
    """The load report's line for FP8 histories absent from the checkpoint."""
    layers = {key.rsplit(".", 1)[0] for key in history_keys}
    return (f"FP8 amax histories of {len(layers)} layer(s) (not in the checkpoint, e.g. from a run without "
            "delayed FP8 scaling): they start empty")

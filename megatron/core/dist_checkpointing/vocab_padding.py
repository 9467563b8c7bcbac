"""Loading a checkpoint whose vocabulary padding differs from the model's.

Megatron pads the vocabulary to a multiple of `--make-vocab-size-divisible-by` x the tensor-parallel size, so
the same 120-token model has 128 embedding rows at TP1 and 256 at TP2 (with the default 128). The word
embedding, the output layer and their optimizer state then differ in dim 0 only, and only in rows past the true
vocabulary, which never map to a token. Such a tensor is loaded through a view of its first
`min(saved rows, model rows)` rows, presented to DCP with the saved shape; the model's other rows keep their
values (main weights follow them) and their optimizer moments are zero, as for a parameter never stepped.

Every wrapper's load targets are `ShardedLogicalTensor`s (TP partitions, distributed-optimizer flat ranges cut
into boxes, FSDP rows), so one rewrite of the targets serves them all.
"""

from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor

VOCAB_TENSOR_NAMES = ("embedding.word_embeddings.weight", "output_layer.weight")
MODEL_PREFIX = "model."
OPTIMIZER_STATE_PREFIX = "optimizer.state."
MAIN_PARAM_KEY = "fp32_param"  # main weights follow the model's rows; every other state key is a moment


class PaddingChange(NamedTuple):
    """Checkpoint key `key` (of logical tensor `name`) has `saved_rows` rows; the model has `model_rows`."""

    key: str
    name: str
    saved_rows: int
    model_rows: int

    @property
    def loaded_rows(self) -> int:
        return min(self.saved_rows, self.model_rows)


def vocab_tensor_of(key: str) -> Optional[Tuple[str, Optional[str]]]:
    """(logical vocab tensor name, optimizer state key or None for the weights) of a checkpoint key, or None."""
    for name in VOCAB_TENSOR_NAMES:
        if key == MODEL_PREFIX + name:
            return name, None
        prefix = f"{OPTIMIZER_STATE_PREFIX}{name}."
        if key.startswith(prefix) and "." not in key[len(prefix):]:
            return name, key[len(prefix):]
    return None


def adapt_targets(targets: Dict[str, object], saved_shapes: Dict[str, torch.Size],
                  vocab_size: Optional[int]) -> List[PaddingChange]:
    """Rewrite the vocab targets whose saved shape differs from the model's in dim 0 only, both at least
    `vocab_size` rows, to load rows `[0, min)`; zero the moments' other rows. Other shape differences are
    left for `serialization.check_shapes` to report. Returns what changed (empty without a `vocab_size`)."""
    changes = []
    if vocab_size is None:
        return changes
    for key, target in list(targets.items()):
        parsed = vocab_tensor_of(key)
        saved = saved_shapes.get(key)
        if parsed is None or saved is None or not isinstance(target, ShardedLogicalTensor):
            continue
        current = target.global_shape
        if saved == current or len(saved) != len(current) or saved[1:] != current[1:]:
            continue
        if min(saved[0], current[0]) < vocab_size:
            continue  # not a padding change: fewer rows than tokens on one side
        change = PaddingChange(key, parsed[0], int(saved[0]), int(current[0]))
        if parsed[1] not in (None, MAIN_PARAM_KEY):
            with torch.no_grad():
                for view in target.rows_from(change.loaded_rows):
                    view.zero_()
        targets[key] = target.leading_rows(change.loaded_rows, change.saved_rows)
        changes.append(change)
    return changes

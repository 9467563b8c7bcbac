"""`save(..., validate_access_integrity=True)`: upstream's check that the ranks' ShardedTensors tile each tensor.

For every ShardedTensor key, all ranks must agree on the global shape, and the pieces of the main replicas
(`replica_id` 0) must cover every element exactly once: a gap would be saved as garbage, an overlap means two
ranks claim the same elements (usually a wrong rank offset or replica_id). Only upstream's `ShardedTensor`s are
checked: other sharded entries are written once per identical piece whatever rank holds them.
"""

import math
from typing import Dict, List, Tuple

import torch.distributed as dist

from megatron.core.dist_checkpointing.errors import CheckpointError
from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offsets, sizes)


def _described(sharded: Dict[str, object]) -> Dict[str, Tuple[Tuple[int, ...], List[Box]]]:
    """{key: (global shape, this rank's main-replica boxes)} of the ShardedTensors of a flat sharded dict."""
    described = {}
    for value in sharded.values():
        if isinstance(value, ShardedTensor):
            boxes = [(tuple(offsets), tuple(tensor.shape)) for offsets, tensor in value.pieces
                     if is_main_replica(value.replica_id)]
            described[value.key] = (tuple(value.global_shape), boxes)
    return described


def _overlap(first: Box, second: Box) -> bool:
    return all(a < b + b_size and b < a + a_size
               for a, a_size, b, b_size in zip(first[0], first[1], second[0], second[1]))


def _problem(key, shapes_by_rank, boxes_by_rank) -> str:
    shapes = {shape for shape in shapes_by_rank.values()}
    if len(shapes) > 1:
        listed = ", ".join(f"rank {rank}: {shape}" for rank, shape in sorted(shapes_by_rank.items()))
        return f"ShardedTensor '{key}' has different global shapes on different ranks ({listed})"
    shape = shapes.pop()
    boxes = [(rank, box) for rank, rank_boxes in sorted(boxes_by_rank.items()) for box in rank_boxes]
    for index, (rank, box) in enumerate(boxes):
        for other_rank, other in boxes[index + 1:]:
            if _overlap(box, other):
                return (f"ShardedTensor '{key}': the main replicas (replica_id 0) of ranks {rank} and {other_rank} "
                        f"both hold elements at offsets {box[0]} / {other[0]}; give each piece its own rank offset, "
                        "and replicas a replica_id other than 0")
    covered, total = sum(math.prod(sizes) for _, (_, sizes) in boxes), math.prod(shape)
    if covered != total:
        return (f"ShardedTensor '{key}': the main replicas (replica_id 0) cover {covered} of its {total} elements "
                f"(global shape {shape}); every element needs one rank with replica_id 0")
    return ""


def validate_sharding_integrity(sharded: Dict[str, object], process_group=None) -> None:
    """Collective over `process_group` (when one is initialised): raise a CheckpointError naming the first
    ShardedTensor whose pieces do not tile it, on every rank."""
    described = _described(sharded)
    if dist.is_available() and dist.is_initialized():
        gathered = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(gathered, described, group=process_group)
    else:
        gathered = [described]
    for key in sorted({key for per_rank in gathered for key in per_rank}):
        shapes = {rank: per_rank[key][0] for rank, per_rank in enumerate(gathered) if key in per_rank}
        boxes = {rank: per_rank[key][1] for rank, per_rank in enumerate(gathered) if key in per_rank}
        problem = _problem(key, shapes, boxes)
        if problem:
            raise CheckpointError(f"cannot save: {problem} (save(..., validate_access_integrity=False) skips this "
                                  "check)")

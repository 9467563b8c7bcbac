"""Which saved rank's random-number streams a rank restores, when the checkpoint was written at another layout.

A stream's seed is a function of the rank's coordinates in the parallel layout (`initialize.set_random_seed`,
`tensor_parallel.random.model_parallel_cuda_manual_seed`):

| streams | seeded from |
|---|---|
| default generators (Python, NumPy, torch, device) and the tracker's data-parallel stream | pipeline rank |
| the tracker's model-parallel stream | pipeline and tensor-parallel ranks |
| the tracker's expert-parallel stream | pipeline, tensor- and expert-parallel ranks |

plus the data-parallel rank for all of them under `--data-parallel-random-init`. A rank restores a stream from
the saved rank whose coordinates were the same along the dims that stream is seeded from: that saved stream is
the very stream this rank seeded, one training step further. Where no saved rank had those coordinates (a
tensor-parallel rank the checkpoint's smaller TP size did not have, say), the stream keeps its seeded state and
the load report says so. Along the dims a stream does not depend on, the saved rank with the same coordinate is
preferred (at the same layout every rank restores exactly its own states), else the lowest one.

Pure arithmetic on coordinates: no process group, unit-testable alone.
"""

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

DEFAULT_STATE_KEYS = ("random_rng_state", "np_rng_state", "torch_rng_state", "device_rng_state")
TRACKER_KEY = "rng_tracker_states"
DATA_PARALLEL_STREAM = "data-parallel-rng"
MODEL_PARALLEL_STREAM = "model-parallel-rng"
EXPERT_PARALLEL_STREAM = "expert-parallel-rng"
DIMS = ("tensor", "pipeline", "data", "expert")


class RankCoordinates(NamedTuple):
    tensor: int
    pipeline: int
    data: int
    expert: int = 0


class StreamGroup(NamedTuple):
    """Streams seeded from the same coordinates: `state_keys` of a rank's RNG state dict, `tracker_streams` of
    its tracker states."""

    name: str
    seeded_from: Tuple[str, ...]
    state_keys: Tuple[str, ...]
    tracker_streams: Tuple[str, ...]


STREAM_GROUPS = (
    StreamGroup("default generators", ("pipeline",), DEFAULT_STATE_KEYS, (DATA_PARALLEL_STREAM,)),
    StreamGroup("model-parallel stream", ("pipeline", "tensor"), (), (MODEL_PARALLEL_STREAM,)),
    StreamGroup("expert-parallel stream", ("pipeline", "tensor", "expert"), (), (EXPERT_PARALLEL_STREAM,)),
)


class StreamSource(NamedTuple):
    """The saved rank `group` is restored from, or None and why not."""

    group: StreamGroup
    saved_rank: Optional[int]
    reason: str = ""


_DIM_FLAGS = {"tensor": "tensor-parallel", "pipeline": "pipeline", "data": "data-parallel", "expert": "expert-parallel"}


def _describe(coordinates: RankCoordinates, dims: Sequence[str]) -> str:
    return ", ".join(f"{_DIM_FLAGS[dim]} rank {getattr(coordinates, dim)}" for dim in dims)


def stream_sources(saved: Dict[int, RankCoordinates], current: RankCoordinates, data_parallel_random_init: bool,
                   saved_data_parallel_random_init: bool) -> List[StreamSource]:
    """For each stream group, the saved rank (key of `saved`) this rank restores it from, or None with a reason."""
    if data_parallel_random_init and not saved_data_parallel_random_init:
        reason = ("the checkpoint was written without --data-parallel-random-init: its data-parallel ranks share "
                  "one stream, this run gives each its own")
        return [StreamSource(group, None, reason) for group in STREAM_GROUPS]
    sources = []
    for group in STREAM_GROUPS:
        key_dims = group.seeded_from + (("data",) if data_parallel_random_init else ())
        matches = [rank for rank, coordinates in saved.items()
                   if all(getattr(coordinates, dim) == getattr(current, dim) for dim in key_dims)]
        if not matches:
            sources.append(StreamSource(group, None, f"no rank of the checkpoint had {_describe(current, key_dims)}"))
            continue
        other_dims = [dim for dim in DIMS if dim not in key_dims]
        # prefer the saved rank that agrees on the most other coordinates, then the lowest coordinates
        best = min(matches, key=lambda rank: (
            sum(getattr(saved[rank], dim) != getattr(current, dim) for dim in other_dims),
            [getattr(saved[rank], dim) for dim in other_dims], rank))
        sources.append(StreamSource(group, best, ""))
    return sources


def restored_state(current_state: dict, saved_states: Dict[int, dict], sources: List[StreamSource]) -> dict:
    """`current_state` (a rank's RNG state dict) with every stream that has a source replaced by the saved one."""
    state = dict(current_state)
    tracker = dict(current_state.get(TRACKER_KEY, {}))
    for source in sources:
        if source.saved_rank is None:
            continue
        saved = saved_states[source.saved_rank]
        for key in source.group.state_keys:
            if key in saved:
                state[key] = saved[key]
        for stream in source.group.tracker_streams:
            if stream in saved.get(TRACKER_KEY, {}):
                tracker[stream] = saved[TRACKER_KEY][stream]
    state[TRACKER_KEY] = tracker
    return state


def summarize(outcomes: Sequence[Sequence[Tuple[str, Optional[int], str]]]) -> Tuple[List[str], List[str]]:
    """(restored, not restored) report phrases from every rank's `(group name, saved rank, reason)` outcomes,
    `outcomes[rank]`; ranks sharing an outcome are listed together."""
    restored, not_restored = {}, {}
    for rank, rank_outcomes in enumerate(outcomes):
        for name, saved_rank, reason in rank_outcomes:
            if saved_rank is None:
                not_restored.setdefault((name, reason), []).append(rank)
            else:
                restored.setdefault(name, []).append(rank)
    world = len(outcomes)

    def ranks(listed):
        return "every rank" if len(listed) == world else "rank" + ("s " if len(listed) > 1 else " ") + \
            ", ".join(map(str, listed))

    return ([f"{name} on {ranks(listed)}" for name, listed in restored.items()],
            [f"{name} on {ranks(listed)} ({reason}; it keeps its seeded state)"
             for (name, reason), listed in not_restored.items()])

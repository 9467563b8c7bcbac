"""All-gathers of several parameter groups posted as one exchange.

Where a process group's all-gathers are built from point-to-point messages (gloo, `collectives.gathers_in_place`),
each costs about as much host time for a few KiB as for hundreds: the hand-over to the posting thread, one
message per peer for the small pieces, the wait. `CoalescedGathers` collects the in-place gathers that one call
of `GatherReleasePolicy.gather` starts for several groups over the same process group and posts them as one
`collectives.all_gather_pieces_in_place` call over all their pieces: every piece lands where its own gather would
have put it, the small ones of every group travel together in one message per peer.

Each group gets a handle of its own (`HeldGather`); waiting for any of them waits for the whole exchange (and
copies every group's packed pieces out), which is why a group is only added while its compute buffer is
allocated and stays so until it is waited for (`GatherReleasePolicy.release` waits before it frees).
"""

from typing import Callable, Dict, List

from .collectives import PendingCollective


class HeldGather(PendingCollective):
    """One group's share of a coalesced all-gather: until the exchange is posted, waiting posts it first."""

    def __init__(self, batch: "CoalescedGathers", process_group):
        super().__init__()
        self._batch, self._process_group = batch, process_group
        self.shared = None  # the exchange's handle, once posted

    def wait(self):
        if self.done:
            return
        if self.shared is None:
            self._batch.issue(self._process_group)
        self.shared.wait()
        self.done, self.staging_bytes, self.shared, self._batch = True, 0, None, None


class CoalescedGathers:
    """The in-place all-gathers held for one exchange per process group (in the order their first gather was
    added, the same on every rank). `post(process_group, outputs_by_rank, own_pieces)` posts one exchange and
    returns its handle (`GatherReleasePolicy._issue_gather_in_place`)."""

    def __init__(self, post: Callable[[object, list, list], PendingCollective]):
        self._post = post
        self._held: Dict[int, dict] = {}

    def add(self, process_group, num_bytes: int, outputs_by_rank: list, own_pieces: list) -> HeldGather:
        """Hold one group's gather (its pieces landing in `outputs_by_rank[rank]`, this rank's `own_pieces`) of
        `num_bytes` gathered bytes; returns the group's handle."""
        entry = self._held.setdefault(id(process_group), dict(
            process_group=process_group, outputs=[[] for _ in outputs_by_rank], own=[], handles=[], bytes=0))
        for outputs, pieces in zip(entry["outputs"], outputs_by_rank):
            outputs.extend(pieces)
        entry["own"].extend(own_pieces)
        entry["bytes"] += num_bytes
        handle = HeldGather(self, process_group)
        entry["handles"].append(handle)
        return handle

    def held_bytes(self, process_group) -> int:
        entry = self._held.get(id(process_group))
        return 0 if entry is None else entry["bytes"]

    def issue(self, process_group=None):
        """Post the held gathers over `process_group` (all of them when None) as one exchange each."""
        keys = list(self._held) if process_group is None else [id(process_group)]
        for key in keys:
            entry = self._held.pop(key, None)
            if entry is None:
                continue
            pending = self._post(entry["process_group"], entry["outputs"], entry["own"])
            handles: List[HeldGather] = entry["handles"]
            for handle in handles:
                handle.shared = pending
            handles[0].staging_bytes = pending.staging_bytes  # the packed buffers, counted once

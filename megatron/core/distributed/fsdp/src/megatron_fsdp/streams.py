"""Side streams for the collectives of Megatron-FSDP, and the events the compute stream waits on.

On an accelerator, all-gathers are issued on one side stream and reduce-scatters (and the outer reductions of
HSDP/HFSDP) on another. Each side stream first waits for the work queued on the compute stream so far (the
collective's input is written there), then runs the collective and its local epilogue (the shard sum, the cast
into the main gradients), and records an event. The compute stream waits for that event only where it consumes
the result, so a unit's backward does not queue behind the previous unit's reduce-scatter, and the gather of the
next unit runs beside the current unit's compute. All of it goes through the device-agnostic `torch.Stream`,
`torch.Event` and `torch.accelerator` API.

Buffer lifetimes follow the events, so no `record_stream` is needed: every buffer a side stream reads or writes
(a reduction's flat gradients, a gather's staging buffer and the shard it sends) stays referenced by the
schedule until the compute stream has been made to wait for that collective's event. Only then is it dropped,
so the caching allocator can hand its memory only to work queued after the collective finished.

On the CPU there are no streams: collectives complete in the order they are waited for, and every method here
is a no-op that runs the collective as it is.
"""

import contextlib
from typing import Callable, Optional

import torch

from .collectives import PendingCollective


class CommunicationStreams:
    """The all-gather and reduce-scatter side streams of one device (none on the CPU)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.enabled = self.device.type != "cpu"
        self.all_gather: Optional[torch.Stream] = torch.Stream(device=self.device) if self.enabled else None
        self.reduce_scatter: Optional[torch.Stream] = torch.Stream(device=self.device) if self.enabled else None

    def compute_stream(self) -> torch.Stream:
        return torch.accelerator.current_stream(self.device)

    @contextlib.contextmanager
    def _on(self, stream: torch.Stream):
        stream.wait_stream(self.compute_stream())
        with stream:
            yield

    def issue(self, stream: Optional[torch.Stream], start: Callable[[], PendingCollective]) -> PendingCollective:
        """Run `start()` (which issues a collective) on `stream`; returns what to wait on before using the result.

        On an accelerator the side stream itself waits for the collective and runs its epilogue, so the host
        never blocks; the returned handle makes the current (compute) stream wait for the recorded event."""
        if not self.enabled:
            return start()
        with self._on(stream):
            pending = start()
            pending.wait()  # stream-ordered: the side stream waits for the collective, the host does not
            event = stream.record_event()
        return PendingCollective(epilogue=lambda: self.compute_stream().wait_event(event))

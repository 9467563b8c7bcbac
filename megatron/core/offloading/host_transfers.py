"""Host buffers and the streams that copy to and from them: the one place offloading talks to `torch.cuda`.

The device of a transfer follows its tensors: for CUDA tensors host buffers are pinned (so copies can run
asynchronously) and `CopyStream` queues copies on a side stream, ordered after the work already queued on the
compute stream; for CPU tensors host and device are the same memory, buffers are ordinary and the same calls
copy synchronously. Callers never branch on the device themselves.
"""

import torch


def _is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def pinning_available() -> bool:
    """Page-locked host memory needs a CUDA runtime (a CPU build cannot pin)."""
    return torch.cuda.is_available()


def empty_host_like(tensor: torch.Tensor, dtype=None) -> torch.Tensor:
    """An uninitialised host tensor of `tensor`'s shape (and `dtype`, default its own), pinned where possible."""
    return torch.empty(tensor.shape, dtype=dtype or tensor.dtype, device="cpu", pin_memory=pinning_available())


def host_copy_of(tensor: torch.Tensor, dtype=None) -> torch.Tensor:
    """A host copy of `tensor` (pinned where possible), finished before returning."""
    host = empty_host_like(tensor, dtype)
    host.copy_(tensor.detach())
    return host


class CopyStream:
    """Copies between host and `device`, queued on a side stream when `device` is CUDA and `overlap`.

    `copy(destination, source)` starts a copy after the work queued so far on the compute stream (so the
    source is ready) and returns a `TransferHandle`; `handle.wait_on_host()` blocks the host until it is done
    (before the host reads the destination), `handle.wait_on_device()` makes the compute stream wait for it
    (before device kernels read the destination). Without overlap, or on the CPU, the copy runs synchronously
    on the calling stream and both waits return at once.
    """

    def __init__(self, device, overlap: bool = True):
        self.device = torch.device(device)
        self.overlapped = overlap and _is_cuda(self.device)
        self._stream = torch.cuda.Stream(device=self.device) if self.overlapped else None

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> "TransferHandle":
        if not self.overlapped:
            destination.copy_(source)
            return TransferHandle(None)
        compute_stream = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute_stream)
        with torch.cuda.stream(self._stream):
            destination.copy_(source, non_blocking=True)
            # The caching allocator must not reuse a device operand's memory before the side stream is done.
            for tensor in (destination, source):
                if tensor.is_cuda:
                    tensor.record_stream(self._stream)
            event = torch.cuda.Event()
            event.record(self._stream)
        return TransferHandle(event)


class TransferHandle:
    """Completion of one `CopyStream.copy` (None: it already completed synchronously)."""

    def __init__(self, event):
        self._event = event

    @property
    def asynchronous(self) -> bool:
        return self._event is not None

    def wait_on_host(self):
        if self._event is not None:
            self._event.synchronize()

    def wait_on_device(self, device):
        if self._event is not None:
            torch.cuda.current_stream(torch.device(device)).wait_event(self._event)

"""Memory measurements of one rank: resident-set high-water mark and bytes of training state held.

Peak RSS has two sources. `ru_maxrss` is the kernel's high-water mark for the whole life of the process, exact
but only meaningful when the process ran a single arm. `RssSampler` gives the peak since its `start()`, so a
process that runs several arms can report each arm's peak above the RSS it had when the arm began. On Linux it
resets the kernel's high-water mark at `start()` (writing 5 to `/proc/self/clear_refs`) and reads it (`VmHWM` in
`/proc/self/status`) at `stop()`: exact, and nothing runs while the arm trains. Where that is not allowed it reads
`/proc/self/statm` from a thread every few milliseconds instead; that thread takes the GIL hundreds of times a
second, which slows the training it measures, and it can miss spikes shorter than its period.
"""

import os
import resource
import sys
import threading
import time

import torch

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def current_rss_bytes():
    """Resident set size now; falls back to ru_maxrss where /proc is missing."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * PAGE_BYTES
    except OSError:
        return lifetime_peak_rss_bytes()


def lifetime_peak_rss_bytes():
    """ru_maxrss is KiB on Linux and bytes on macOS."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class RssSampler:
    """Highest RSS between `start()` and `stop()`: the kernel's high-water mark where it can be reset, else
    sampled every `period_s` seconds from a thread. `lifetime_peak_at_start` is `ru_maxrss` before the reset."""

    def __init__(self, period_s=0.002):
        self.period_s = period_s
        self.baseline = 0
        self.peak = 0
        self.lifetime_peak_at_start = 0
        self.uses_kernel_peak = False
        self._stop = threading.Event()
        self._thread = None

    def start(self):
        self.lifetime_peak_at_start = lifetime_peak_rss_bytes()
        self.baseline = current_rss_bytes()
        self.peak = self.baseline
        self.uses_kernel_peak = reset_kernel_peak_rss()
        if not self.uses_kernel_peak:
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss_bytes())
            time.sleep(self.period_s)

    def stop(self):
        if self.uses_kernel_peak:
            self.peak = max(self.peak, kernel_peak_rss_bytes())
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.peak = max(self.peak, current_rss_bytes())
        return self.peak


def reset_kernel_peak_rss() -> bool:
    """Set the kernel's RSS high-water mark of this process to its current RSS; False where that is not possible
    (not Linux, a kernel before 4.0, or /proc not writable)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return kernel_peak_rss_bytes() > 0
    except OSError:
        return False


def kernel_peak_rss_bytes() -> int:
    """`VmHWM` of /proc/self/status in bytes (0 if absent)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _local(tensor):
    """The local shard of a DTensor; the tensor itself otherwise."""
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def _add_storage(seen, tensor):
    """Bytes of `tensor`'s storage if not counted yet (views of one flat buffer count once)."""
    if tensor is None:
        return 0
    tensor = _local(tensor)
    if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
        return 0
    storage = tensor.untyped_storage()
    key = (storage.device.type, storage.data_ptr())
    if key in seen or storage.nbytes() == 0:
        return 0
    seen.add(key)
    return storage.nbytes()


def held_state_bytes(model, optimizer):
    """Bytes of the storages behind parameters, gradients and optimizer state, each storage counted once.

    Parameters are the model's and the optimizer's (a sharded optimizer may step on separate main copies);
    a parameter storage resized to zero after resharding counts nothing. DDP's hidden bucket buffers are not
    tensors the model exposes and are not included.
    """
    seen = set()
    params = [p for p in model.parameters()]
    params += [p for group in optimizer.param_groups for p in group["params"]]
    param_bytes = sum(_add_storage(seen, p) for p in params)
    grad_bytes = sum(_add_storage(seen, p.grad) for p in params)
    optimizer_bytes = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                optimizer_bytes += _add_storage(seen, value)
    return {"params": param_bytes, "grads": grad_bytes, "optimizer": optimizer_bytes}

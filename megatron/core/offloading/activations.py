"""Activation offloading (`--cpu-offloading --cpu-offloading-num-layers N`): the tensors that the chosen
transformer layers save for their backward pass are moved to host memory during the forward pass and copied
back when the backward pass unpacks them.

`ActivationOffloader.hooks(label)` is a `torch.autograd.graph.saved_tensors_hooks` context: inside it, every
saved tensor except parameters (weights stay where they are) is copied into a host buffer (pinned on CUDA,
queued on a side stream after the work that produced it, so the device memory is released once the copy is
done) and the device tensor is dropped; unpacking copies it back to its device on the same stream, and the
compute stream waits for that copy. On the CPU the same path runs as plain copies. Strides are kept where the
tensor is dense, so the backward kernels see the same layouts as without offload and the results are exact.
`packed` / `unpacked` count tensors per label and `packed_bytes` their size, for tests and logs.

Unpacking is on demand (no prefetch of the next layer's tensors while the current layer's backward runs yet).
"""

from collections import Counter

import torch

from megatron.core.offloading.host_transfers import CopyStream, pinning_available


class _OffloadedTensor:
    __slots__ = ("device", "host")

    def __init__(self, device, host):
        self.device = device
        self.host = host


def _dense(tensor) -> bool:
    """Whether `tensor`'s elements fill its span exactly once in some dimension order (a permuted contiguous
    layout), so a fresh buffer can take the same strides."""
    expected = 1
    for dim in sorted(range(tensor.dim()), key=lambda d: (tensor.stride(d), tensor.size(d))):
        if tensor.size(dim) == 1:
            continue
        if tensor.stride(dim) != expected:
            return False
        expected *= tensor.size(dim)
    return True


def _empty_like_layout(tensor, device, pin_memory=False):
    """An empty tensor with `tensor`'s shape, dtype and (where it is dense) strides on `device`."""
    if _dense(tensor):
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device,
                                   pin_memory=pin_memory)
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=device, pin_memory=pin_memory)


class ActivationOffloader:
    """Saved-tensor hooks moving activations to host memory and back; one copy stream per compute device."""

    def __init__(self, overlap: bool = True):
        self.overlap = overlap
        self._streams = {}
        self.packed, self.unpacked, self.packed_bytes = Counter(), Counter(), Counter()

    def _stream(self, device):
        if device not in self._streams:
            self._streams[device] = CopyStream(device, overlap=self.overlap)
        return self._streams[device]

    def hooks(self, label):
        """Context under which the tensors saved for backward are offloaded, counted under `label`."""
        return torch.autograd.graph.saved_tensors_hooks(lambda tensor: self._pack(label, tensor),
                                                        lambda packed: self._unpack(label, packed))

    def _pack(self, label, tensor):
        if isinstance(tensor, torch.nn.Parameter) or tensor.numel() == 0:
            return tensor
        pin = pinning_available() and tensor.device.type == "cuda"
        host = _empty_like_layout(tensor, "cpu", pin_memory=pin)
        self._stream(tensor.device).copy(host, tensor.detach())
        self.packed[label] += 1
        self.packed_bytes[label] += tensor.numel() * tensor.element_size()
        return _OffloadedTensor(tensor.device, host)

    def _unpack(self, label, packed):
        if not isinstance(packed, _OffloadedTensor):
            return packed
        restored = _empty_like_layout(packed.host, packed.device)
        self._stream(packed.device).copy(restored, packed.host).wait_on_device(packed.device)
        self.unpacked[label] += 1
        return restored

    def reset_counters(self):
        self.packed.clear()
        self.unpacked.clear()
        self.packed_bytes.clear()

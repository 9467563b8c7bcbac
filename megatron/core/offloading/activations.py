"""Activation offloading (`--cpu-offloading --cpu-offloading-num-layers N`, and the chosen pieces of every layer
with `--fine-grained-activation-offloading`, see `fine_grained`): the tensors that the chosen transformer layers
save for their backward pass are moved to host memory during the forward pass and copied back when the backward
pass unpacks them.

`ActivationOffloader.hooks(label)` is a `torch.autograd.graph.saved_tensors_hooks` context: inside it, every
saved tensor is copied into a host buffer (pinned on CUDA, queued on a side stream after the work that produced
it, so the device memory is released once the copy is done) and the device tensor is dropped, except weights
(parameters, views of parameters, and tensors marked with `keep_on_device`, such as the experts' stacked weights)
and tensors of fewer than `min_offloaded_tensor_size` elements, which stay where they are. Unpacking copies a
tensor back to its device on the same stream, and the compute stream waits for that copy. On the CPU the same
path runs as plain copies. Strides are kept (a view that does not fill its span, such as the value heads of a
fused QKV output, comes back in a buffer of its span's size), so the backward kernels see the same layouts as
without offload and the results are exact. `packed` / `unpacked` count tensors per label and
`packed_bytes` their size, for tests and logs.

Prefetch: labels are remembered in the order the forward pass first offloaded under them (the layers' order;
with fine-grained offloading, that of the layers' pieces). When the backward pass unpacks the first tensor of a
label, every tensor of that label is queued for the trip back and so is every tensor of the label offloaded just
before it (the layer whose backward runs next), so that layer's copies run on the side stream while the current
layer's backward computes; each unpack then only waits for its own copy. Only one label ahead is reloaded, which
bounds the extra device memory to one layer's (or piece's) activations. Tensors whose graph was freed without
a backward (e.g. an evaluation with gradients enabled) are forgotten with it (weak references).
"""

import weakref
from collections import Counter

import torch

from megatron.core.offloading.host_transfers import CopyStream, pinning_available

_KEEP_ON_DEVICE = "keep_on_device_when_saved"


def keep_on_device(tensor):
    """Mark `tensor` (a weight built in the forward pass, e.g. stacked expert weights) so that saving it for
    backward never offloads it; returns it."""
    setattr(tensor, _KEEP_ON_DEVICE, True)
    return tensor


def _is_weight(tensor) -> bool:
    """A parameter, a view of one (`F.linear` saves `weight.t()`), or a tensor marked by `keep_on_device`."""
    return (isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)
            or getattr(tensor, _KEEP_ON_DEVICE, False))


class _OffloadedTensor:
    """A saved tensor's host copy; while a reload is queued, the device tensor being filled and its copy."""

    __slots__ = ("device", "host", "restored", "handle", "__weakref__")

    def __init__(self, device, host):
        self.device = device
        self.host = host
        self.restored = None
        self.handle = None


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


def _span(tensor) -> int:
    """The number of elements from `tensor`'s first element to its last in its storage (its numel if dense)."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))


def _empty_like_layout(tensor, device, pin_memory=False):
    """An empty tensor with `tensor`'s shape, dtype and strides on `device`. A view that does not fill its span
    (the value heads of a fused QKV output, one half of a gated MLP's input) gets a buffer of the span's size, so
    the backward kernels see the strides they would see without offload and compute the same bits."""
    if _dense(tensor):
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device,
                                   pin_memory=pin_memory)
    span = torch.empty(_span(tensor), dtype=tensor.dtype, device=device, pin_memory=pin_memory)
    return span.as_strided(tensor.shape, tensor.stride())


class ActivationOffloader:
    """Saved-tensor hooks moving activations to host memory and back; one copy stream per compute device.

    `copy_stream` builds the stream of a device (`CopyStream`'s signature); tests pass a recording stand-in.
    Saved tensors of fewer than `min_offloaded_tensor_size` elements stay where they are (0: every non-empty one
    goes; `--min-offloaded-tensor-size` for fine-grained offloading), as do weights."""

    def __init__(self, overlap: bool = True, prefetch: bool = True, copy_stream=CopyStream,
                 min_offloaded_tensor_size: int = 0):
        self.overlap = overlap
        self.prefetch = prefetch
        self.min_offloaded_tensor_size = min_offloaded_tensor_size
        self._copy_stream = copy_stream
        self._streams = {}
        self._label_order = []  # labels in the order the forward pass first offloaded under them
        self._offloaded = {}  # label -> weak set of its tensors not yet handed back
        self._backward_started = set()  # labels whose tensors the backward pass has started unpacking
        self.packed, self.unpacked, self.packed_bytes = Counter(), Counter(), Counter()

    def _stream(self, device):
        if device not in self._streams:
            self._streams[device] = self._copy_stream(device, overlap=self.overlap)
        return self._streams[device]

    def hooks(self, label):
        """Context under which the tensors saved for backward are offloaded, counted under `label`."""
        return torch.autograd.graph.saved_tensors_hooks(lambda tensor: self._pack(label, tensor),
                                                        lambda packed: self._unpack(label, packed))

    def _pack(self, label, tensor):
        if tensor.numel() == 0 or tensor.numel() < self.min_offloaded_tensor_size or _is_weight(tensor):
            return tensor
        pin = pinning_available() and tensor.device.type == "cuda"
        host = _empty_like_layout(tensor, "cpu", pin_memory=pin)
        self._stream(tensor.device).copy(host, tensor.detach())
        self.packed[label] += 1
        self.packed_bytes[label] += tensor.numel() * tensor.element_size()
        packed = _OffloadedTensor(tensor.device, host)
        if label not in self._offloaded:
            self._label_order.append(label)
            self._offloaded[label] = weakref.WeakSet()
        self._backward_started.discard(label)  # a new forward pass under this label
        self._offloaded[label].add(packed)
        return packed

    def _unpack(self, label, packed):
        if not isinstance(packed, _OffloadedTensor):
            return packed
        if self.prefetch and label not in self._backward_started:  # this label's backward begins
            self._backward_started.add(label)
            for other in [*self._offloaded[label], *self._offloaded.get(self._label_before(label), ())]:
                self._reload(other)
        self._reload(packed)  # queued already, unless prefetch is off (or for a second backward)
        restored, handle = packed.restored, packed.handle
        packed.restored = packed.handle = None
        self._offloaded[label].discard(packed)
        handle.wait_on_device(packed.device)
        self.unpacked[label] += 1
        return restored

    def _reload(self, packed):
        """Queue the copy of `packed` back to its device (once)."""
        if packed.restored is None:
            packed.restored = _empty_like_layout(packed.host, packed.device)
            packed.handle = self._stream(packed.device).copy(packed.restored, packed.host)

    def _label_before(self, label):
        """The label offloaded just before `label` in the forward pass: its backward runs next."""
        index = self._label_order.index(label)
        return self._label_order[index - 1] if index > 0 else None

    def reset_counters(self):
        self.packed.clear()
        self.unpacked.clear()
        self.packed_bytes.clear()

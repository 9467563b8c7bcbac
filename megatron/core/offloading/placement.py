"""Where offloaded tensors rest: `HostPlacement`, one device-agnostic decision for every offloading path.

A placement is derived from the compute device alone: tensors at rest go to host memory, page-locked (pinned)
when the compute device is an accelerator whose runtime can pin (so copies to and from it can be asynchronous),
ordinary memory otherwise (on a CPU run host and device are the same memory; the same code runs, the copies are
plain copies). Callers ask the placement for buffers and never branch on the device themselves.

Relocating a parameter: an optimizer may move a tensor's storage to the host (`relocate_to_host`) only when the
tensor's owner said it may (`mark_relocatable`): the distributed optimizer's main parameters are clones owned by
nobody else, while Megatron-FSDP's main weights are views into flat buffers the wrapper keeps reading, and must
stay where they are.
"""

import dataclasses

import torch

from megatron.core.offloading.host_transfers import pinning_available

RELOCATABLE_ATTRIBUTE = "storage_relocatable"


def mark_relocatable(tensor: torch.Tensor) -> torch.Tensor:
    """Say that `tensor` owns its storage alone, so an offloading optimizer may move it to the host."""
    setattr(tensor, RELOCATABLE_ATTRIBUTE, True)
    return tensor


def is_relocatable(tensor: torch.Tensor) -> bool:
    return bool(getattr(tensor, RELOCATABLE_ATTRIBUTE, False))


@dataclasses.dataclass(frozen=True)
class HostPlacement:
    """Host memory for tensors offloaded from `compute_device`; `pin_memory` when that device can use it."""

    compute_device: torch.device
    pin_memory: bool
    host_device: torch.device = torch.device("cpu")

    @classmethod
    def for_device(cls, compute_device, can_pin=None) -> "HostPlacement":
        """The placement for `compute_device`; `can_pin` defaults to whether this process can pin memory."""
        compute_device = torch.device(compute_device)
        can_pin = pinning_available() if can_pin is None else can_pin
        return cls(compute_device, pin_memory=bool(can_pin) and compute_device.type != "cpu")

    def empty_like(self, tensor: torch.Tensor, dtype=None) -> torch.Tensor:
        """An uninitialised host tensor of `tensor`'s shape (and `dtype`, default its own)."""
        return torch.empty(tensor.shape, dtype=dtype or tensor.dtype, device=self.host_device,
                           pin_memory=self.pin_memory)

    def copy_of(self, tensor: torch.Tensor, dtype=None) -> torch.Tensor:
        """A host copy of `tensor`, complete when this returns."""
        host = self.empty_like(tensor, dtype)
        host.copy_(tensor.detach())
        return host

    def relocate_to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Move `tensor`'s values into a new host buffer and make `tensor` use it (same Python object, so every
        holder of the parameter sees the move); the previous storage is released. Returns the host buffer."""
        if not is_relocatable(tensor):
            raise ValueError("relocate_to_host: the tensor's owner did not mark it relocatable (it may be a view "
                             "into a buffer its owner keeps reading); copy it instead")
        host = self.copy_of(tensor)
        tensor.data = host
        return host

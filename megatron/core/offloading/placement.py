"""Where offloaded tensors rest: `HostPlacement`, one device-agnostic decision for every offloading path.

A placement is derived from the compute device alone: tensors at rest go to host memory, page-locked (pinned)
when the compute device is an accelerator whose runtime can pin (so copies to and from it can be asynchronous),
ordinary memory otherwise (on a CPU run host and device are the same memory; the same code runs, the copies are
plain copies). Callers ask the placement for buffers and never branch on the device themselves.

Relocating a parameter: an optimizer may move a tensor's storage to the host (`relocate_to_host`) only when the
tensor's owner said it may (`mark_relocatable`): the distributed optimizer's main parameters of a bf16/fp16
model are clones owned by nobody else (an fp32 model's are views of DDP's parameter buffer and stay), and
Megatron-FSDP's fp32 main weights once the wrapper gave them storages of their own; its main weights in the
compute dtype are views into the compute weights the wrapper keeps reading, and must stay where
they are. An owner may also name an `InstallTarget`, the device tensor it reads the values from (the model's
compute weights): the offloading optimizer then copies the new values there itself after each host step, on its
upload stream (a side stream with overlapped copies), and tells the owner it did.
"""

import dataclasses
from typing import Callable, Optional

import torch

from megatron.core.offloading.host_transfers import pinning_available

RELOCATABLE_ATTRIBUTE = "storage_relocatable"
INSTALL_TARGET_ATTRIBUTE = "host_step_install_target"


@dataclasses.dataclass(frozen=True)
class InstallTarget:
    """Where the owner of a relocated tensor reads its values on the device (`tensor`: same number of elements,
    any dtype, e.g. the model's bf16 compute weights), and `on_installed()`, called once the new values are queued
    there (the owner then need not copy them itself)."""

    tensor: torch.Tensor
    on_installed: Callable[[], None]


def mark_relocatable(tensor: torch.Tensor, install_into: Optional[InstallTarget] = None) -> torch.Tensor:
    """Say that `tensor` owns its storage alone, so an offloading optimizer may move it to the host; with
    `install_into`, the optimizer also copies the values it steps there (see the module docstring)."""
    setattr(tensor, RELOCATABLE_ATTRIBUTE, True)
    setattr(tensor, INSTALL_TARGET_ATTRIBUTE, install_into)
    return tensor


def is_relocatable(tensor: torch.Tensor) -> bool:
    return bool(getattr(tensor, RELOCATABLE_ATTRIBUTE, False))


def install_target_of(tensor: torch.Tensor) -> Optional[InstallTarget]:
    return getattr(tensor, INSTALL_TARGET_ATTRIBUTE, None)


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

"""Parameter and gradient offload (`param_offload`, ZeRO-3 only): the shard-sized buffers rest in host memory.

Under `optim_grads_params` a group keeps, between its uses, only shard-sized buffers: the compute shard, the
main weights (the same buffer when the dtypes match) and the main gradients. With `param_offload` those live
in host memory, pinned where the compute device can use pinned memory (`ShardOffload.for_device`); the flat
compute buffer stays on the device. Where the data moves:
- gather: the shard a rank sends is copied to the device first (`to_compute_device`), all-gathered into the
  device compute buffer, used by the unit's forward or backward and released as without offload;
- gradient reduction: the reduce-scatter lands in a device buffer and its result is added into the host main
  gradients (`collectives.reduce_scatter_flat` stores across devices);
- the optimizer steps the host main weights with the host gradients (its state is created next to them), and
  installing the new weights writes the host compute shard, read by the next gather.
On a CPU-only run host and device are the same memory: the same code runs and the copies are plain copies.
"""

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class ShardOffload:
    """Where a group's shard buffers rest: `host_device` memory, pinned when `pin_memory`."""

    compute_device: torch.device
    pin_memory: bool
    host_device: torch.device = torch.device("cpu")

    @classmethod
    def for_device(cls, compute_device, can_pin=None) -> "ShardOffload":
        """Host memory for shards computed on `compute_device`; pinned only for an accelerator that can use it
        (`can_pin` defaults to whether this process can pin: a CUDA runtime is present)."""
        compute_device = torch.device(compute_device)
        can_pin = torch.cuda.is_available() if can_pin is None else can_pin
        return cls(compute_device, pin_memory=bool(can_pin) and compute_device.type != "cpu")

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed shard buffer in host memory."""
        buffer = torch.empty(numel, dtype=dtype, device=self.host_device, pin_memory=self.pin_memory)
        return buffer.zero_()

    def to_compute_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of a host shard on the compute device, for a collective (the tensor itself on a CPU run)."""
        return tensor.to(self.compute_device, non_blocking=self.pin_memory)

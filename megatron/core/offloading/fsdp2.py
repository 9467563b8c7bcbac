"""PyTorch FSDP2's parameter offload (`--torch-fsdp2-cpu-offload`): the offload policy handed to `fully_shard`.

Under torch's `CPUOffloadPolicy` the sharded parameters and their reduced gradient shards rest in host memory;
each unit's all-gather copies its shards to the device first, the gathered weights are freed after use as usual,
and the gradients are copied to the host after their reduce-scatter, so the optimizer steps on the host.
Pinning follows `HostPlacement` (pinned buffers only where the compute device can use them), so the same policy
runs on a CPU mesh, where host and device are the same memory.
"""

import torch

from megatron.core.offloading.placement import HostPlacement


def fsdp2_offload_policy(cpu_offload: bool, device_type: str, can_pin=None):
    """The `offload_policy` argument of `fully_shard` for a mesh of `device_type`: torch's default (no offload)
    or a `CPUOffloadPolicy` pinned as `HostPlacement` decides."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not cpu_offload:
        return OffloadPolicy()
    placement = HostPlacement.for_device(torch.device(device_type), can_pin=can_pin)
    return CPUOffloadPolicy(pin_memory=placement.pin_memory)

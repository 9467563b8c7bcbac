"""`HostPlacement`: where offloaded tensors rest (pinned host memory only for an accelerator that can pin),
and moving a tensor its owner marked relocatable; the hybrid optimizer on such tensors keeps their master
values and state on the host (checked against real device memory in a `gpu` test)."""

import dataclasses

import pytest
import torch

from megatron.core.offloading.host_transfers import pinning_available
from megatron.core.offloading.placement import HostPlacement, is_relocatable, mark_relocatable
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.optimizer.precision_aware_adam import PrecisionAwareAdamW
from tests.unit_tests.offloading.same_step import assert_same_step


@pytest.mark.parametrize("device, can_pin, pinned", [("cuda", True, True), ("cuda", False, False),
                                                     ("cpu", True, False), ("cpu", False, False)])
def test_placement_pins_only_for_an_accelerator_that_can_pin(device, can_pin, pinned):
    placement = HostPlacement.for_device(device, can_pin=can_pin)
    assert placement == HostPlacement(torch.device(device), pinned, torch.device("cpu"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        placement.pin_memory = not pinned


def test_relocation_moves_the_storage_of_marked_tensors_only():
    placement = HostPlacement.for_device("cpu")
    values = torch.arange(6.0).view(2, 3)
    owned = torch.nn.Parameter(values.clone())
    original_pointer = owned.data_ptr()
    with pytest.raises(ValueError, match="did not mark it relocatable"):
        placement.relocate_to_host(owned)
    assert owned.data_ptr() == original_pointer
    mark_relocatable(owned)
    host = placement.relocate_to_host(owned)
    assert is_relocatable(owned) and isinstance(owned, torch.nn.Parameter)
    assert owned.data_ptr() == host.data_ptr() != original_pointer  # the same object on the new storage
    assert torch.equal(owned, values) and owned.shape == (2, 3)
    host.add_(1)  # the optimizer steps the host buffer: the parameter sees it
    assert torch.equal(owned, values + 1)


def _adamw(groups):
    return PrecisionAwareAdamW(groups, lr=1e-2, weight_decay=0.1)


def _main_params(device, relocatable):
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator).to(device))
              for shape in [(256, 64), (64,), (64, 32)]]
    return [mark_relocatable(param) if relocatable else param for param in params]


def _step_three_times(optimizer, params, device):
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        for param in params:
            param.decoupled_grad = torch.randn(param.shape, generator=generator).to(device)
        optimizer.step()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_relocated_main_params_step_on_the_host_like_on_the_device(device):
    reference, offloaded = _main_params(device, False), _main_params(device, True)
    _step_three_times(_adamw([{"params": reference}]), reference, device)
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    hybrid = HybridDeviceOptimizer([{"params": offloaded}], _adamw, _adamw, offload_fraction=1.0)
    _step_three_times(hybrid, offloaded, device)
    assert hybrid.device_optimizer is None and all(entry.relocated for entry in hybrid.offloaded)
    for mine, theirs in zip(offloaded, reference):
        assert mine.device.type == "cpu" and mine.is_pinned() == (device == "cuda" and pinning_available())
        assert_same_step(mine, theirs, device)
        assert hybrid.state[mine]["exp_avg"].device.type == "cpu"
    if device == "cuda":
        for param in offloaded:
            param.decoupled_grad = None  # the model's gradient buffers, not the optimizer's
        torch.cuda.synchronize()
        # The device gave back the 4-byte master weights and never held the 8 bytes of moments.
        numel = sum(param.numel() for param in offloaded)
        assert torch.cuda.memory_allocated() <= before - 4 * numel

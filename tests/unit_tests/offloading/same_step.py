"""Comparing an optimizer step taken on the host with one taken on the device."""

import torch


def assert_same_step(host_value, device_value, device):
    """Equal where both ran on the CPU. Where the reference stepped on a GPU the two differ by rounding only: the
    CUDA and CPU kernels of AdamW round the square root, the division and the fused multiply-adds differently
    (1 to 2 fp32 units in the last place per operation, over three steps), so the bound is 1e-5 relative; a
    wrong step (a missed or doubled update, a stale moment) is off by the step itself, ~1e-2 here."""
    host_value, device_value = host_value.detach().cpu(), device_value.detach().cpu()
    if torch.device(device).type == "cpu":
        assert torch.equal(host_value, device_value)
    else:
        torch.testing.assert_close(host_value, device_value, rtol=1e-5, atol=1e-7)

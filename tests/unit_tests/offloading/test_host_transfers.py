"""Host buffers and copy streams, and the hybrid optimizer on one process: on CUDA pinned host memory and
side-stream copies (a `gpu` test), on the CPU the same calls as synchronous copies (the same test body)."""

import pytest
import torch

from megatron.core.offloading.host_transfers import CopyStream, empty_host_like, host_copy_of, pinning_available
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.optimizer.precision_aware_adam import PrecisionAwareAdamW
from tests.unit_tests.offloading.same_step import assert_same_step

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_copy_stream_round_trip(device):
    source = torch.arange(4096, dtype=torch.float32, device=device) * 0.5
    host = empty_host_like(source)
    assert host.device.type == "cpu" and host.is_pinned() == (device == "cuda") == pinning_available()
    stream = CopyStream(device, overlap=True)
    download = stream.copy(host, source)
    assert download.asynchronous == (device == "cuda")  # side stream on CUDA, a plain copy on the CPU
    download.wait_on_host()
    assert torch.equal(host, source.cpu())
    host.mul_(2)
    back = torch.empty_like(source)
    upload = stream.copy(back, host)
    upload.wait_on_device(device)
    assert torch.equal(back.cpu(), source.cpu() * 2)
    assert torch.equal(host_copy_of(source), source.cpu())
    assert not CopyStream(device, overlap=False).copy(host, source).asynchronous


def _params(device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(32, 16), (16,), (16, 8), (8,)]
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).to(device)) for shape in shapes]


def _adamw(groups):
    return PrecisionAwareAdamW(groups, lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overlap", [False, True])
def test_hybrid_optimizer_steps_like_the_device_optimizer(device, overlap):
    reference, offloaded = _params(device), _params(device)
    plain = _adamw([{"params": reference}])
    hybrid = HybridDeviceOptimizer([{"params": offloaded}], _adamw, _adamw, offload_fraction=0.5,
                                   overlap_d2h_h2d=overlap)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        for mine, theirs in zip(offloaded, reference):
            grad = torch.randn(mine.shape, generator=generator).to(device)
            mine.grad, theirs.grad = grad.clone(), grad.clone()
        plain.step()
        hybrid.step()
    host_params = [entry.host_param for entry in hybrid.offloaded]
    assert [entry.device_param for entry in hybrid.offloaded] == offloaded[:1]  # 512 of 792 elements
    assert all(param.device.type == "cpu" and param.is_pinned() == pinning_available() for param in host_params)
    assert len(hybrid.host_steps) == 1 and hybrid.device_optimizer is not None
    for mine, theirs in zip(offloaded, reference):
        assert_same_step(mine, theirs, device)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_same_step(hybrid.state[mine][key], plain.state[theirs][key], device)
    assert hybrid.state[offloaded[0]]["exp_avg"].device.type == "cpu"  # the offloaded state lives on the host
    assert hybrid.state[offloaded[1]]["exp_avg"].device.type == torch.device(device).type

"""`megatron_fsdp.clip_grad_norm_`: the norm (2 and inf) and the clipped gradients equal torch's on the same
gradients; the norm is computed by one foreach kernel on the model's device, and nothing is read back to the host.

The device checks run on the meta device: a meta tensor cannot be copied to the host, so any host
synchronisation (`float(norm)`, `.item()`, a Python comparison of the coefficient) raises, and any tensor the
function creates on another device than the model's shows up in the result's device."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_fsdp.distributed_data_parallel_config import ShardingStrategy
from megatron_fsdp.optimizer import clip_grad_norm_


class _FakeGroup:
    def __init__(self, grads):
        self.grads = grads
        self.params = [torch.nn.Parameter(torch.empty(0)) for _ in grads]

    def optimizer_grad_views(self):
        return self.grads


def _fake_model(grads, device):
    """A single-rank, unsharded model holding `grads` (no collectives run)."""
    topology = SimpleNamespace(tp_size=1, outer_shards_optimizer=False, dp_group=None)
    return SimpleNamespace(finish_grad_sync=lambda: None, groups=[_FakeGroup(grads)], topology=topology,
                           strategy=ShardingStrategy.no_shard, device=torch.device(device))


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_norm_and_clipping_equal_torch(norm_type):
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=generator) for shape in ((5, 3), (7,), (1,), (4, 4))]
    expected = [g.clone() for g in grads]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in expected]
    for param, grad in zip(params, expected):
        param.grad = grad
    max_norm = 0.3
    expected_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type, foreach=True)
    recorder = _OpRecorder()
    with recorder:
        norm = clip_grad_norm_(_fake_model(grads, "cpu"), max_norm, norm_type=norm_type)
    torch.testing.assert_close(norm, expected_norm, rtol=1e-6, atol=0)
    for grad, param in zip(grads, params):
        torch.testing.assert_close(grad, param.grad, rtol=1e-6, atol=0)
    # one foreach norm for all four gradients, no per-gradient norm kernel, one foreach multiply to clip
    assert recorder.ops.count("_foreach_norm") == 1, recorder.ops
    assert "linalg_vector_norm" not in recorder.ops and "norm" not in recorder.ops, recorder.ops
    assert recorder.ops.count("_foreach_mul_") == 1, recorder.ops


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_norm_stays_on_the_model_device_without_host_sync(norm_type):
    grads = [torch.empty(5, 3, device="meta"), torch.empty(7, device="meta")]
    norm = clip_grad_norm_(_fake_model(grads, "meta"), 1.0, norm_type=norm_type)
    assert norm.device.type == "meta" and norm.shape == ()
    # a rank holding no gradient elements (a tiny model on many ranks) still all-reduces a tensor on the
    # model's device, never a CPU tensor that NCCL cannot reduce
    empty = clip_grad_norm_(_fake_model([], "meta"), 1.0, norm_type=norm_type)
    assert empty.device.type == "meta"

"""The gradient norm the NaN / large-gradient check reads (`megatron/training/result_validation.py`)."""

import math

import torch

from megatron.training.result_validation import local_grad_norm


def _chunk_with_grads(grads):
    chunk = torch.nn.Module()
    for index, grad in enumerate(grads):
        param = torch.nn.Parameter(torch.zeros_like(grad))
        if index % 2:
            param.main_grad = grad  # DDP's accumulated gradient
        else:
            param.grad = grad
        chunk.register_parameter(f"p{index}", param)
    return chunk


def test_norm_of_many_gradients_copies_to_the_host_once(monkeypatch):
    """One copy to the host per device for the whole norm (on an accelerator every `.cpu()` / `.item()` of a
    device tensor waits for the device), whatever the number of gradients; the value is the L2 norm over all of
    them, bf16 gradients read in fp32."""
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=generator) for shape in ((7, 5), (3,), (4, 4, 2), (11,))] * 10
    grads.append(torch.randn(6, 6, generator=generator).to(torch.bfloat16))
    chunks = [_chunk_with_grads(grads[:20]), _chunk_with_grads(grads[20:])]
    transfers = []
    for name in ("cpu", "item", "tolist"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):
            transfers.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    norm = local_grad_norm(chunks)
    monkeypatch.undo()
    assert transfers == ["cpu"]
    expected = math.sqrt(sum(float(grad.double().square().sum()) for grad in grads))
    assert norm.dtype == torch.float32 and norm.device.type == "cpu"
    assert abs(norm.item() - expected) <= 1e-6 * expected


def test_nan_and_inf_gradients_give_a_non_finite_norm():
    for bad in (float("nan"), float("inf")):
        grad = torch.ones(5)
        grad[2] = bad
        norm = local_grad_norm([_chunk_with_grads([torch.ones(3), grad])])
        assert not math.isfinite(norm.item())
    assert local_grad_norm([torch.nn.Linear(2, 2)]).item() == 0.0  # no gradients yet

"""The GPT model on a CUDA device computes what it computes on the CPU (runs only where a GPU is present)."""

import pytest
import torch

from tests.unit_tests.models.gpt.gpt_test_utils import fixed_batch, seeded_model, tiny_config


def _per_token_loss_on(device):
    model = seeded_model(tiny_config()).to(device)
    tokens, labels, position_ids = (tensor.to(device) for tensor in fixed_batch())
    loss = model(tokens, position_ids, labels=labels)
    loss.sum().backward()
    grad_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))
    return loss.detach().cpu(), grad_norm.item()


@pytest.mark.gpu
def test_gpt_on_cuda_matches_cpu():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cpu_loss, cpu_grad_norm = _per_token_loss_on("cpu")
    cuda_loss, cuda_grad_norm = _per_token_loss_on("cuda")
    # Different kernels sum in different orders: fp32 agreement to ~1e-5 relative, not bit equality.
    torch.testing.assert_close(cuda_loss, cpu_loss, rtol=1e-4, atol=1e-5)
    assert cuda_grad_norm == pytest.approx(cpu_grad_norm, rel=1e-4)

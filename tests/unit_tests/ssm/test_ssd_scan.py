"""The chunked Mamba-2 scan against the recurrence it computes, step by step in float64: outputs, final state and
gradients, for chunk sizes that divide the sequence, do not, or exceed it, and with an initial state."""

import pytest
import torch

from megatron.core.ssm.ssd_scan import segment_sums, ssd_chunked_scan

BATCH, LENGTH, HEADS, HEAD_DIM, STATE = 2, 37, 3, 4, 5


def recurrence(x, dt, A, B, C, initial_state=None):
    """S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t, one token at a time."""
    state = torch.zeros(BATCH, HEADS, HEAD_DIM, STATE, dtype=x.dtype) if initial_state is None else initial_state
    outputs = []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        state = decay * state + (dt[:, t, :, None, None] * x[:, t, :, :, None] * B[:, t, :, None, :])
        outputs.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    return torch.stack(outputs, dim=1), state


def _inputs(dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, LENGTH, HEADS, HEAD_DIM, generator=generator, dtype=dtype)
    dt = torch.rand(BATCH, LENGTH, HEADS, generator=generator, dtype=dtype) * 0.5 + 0.01
    A = -(torch.rand(HEADS, generator=generator, dtype=dtype) * 3 + 0.1)
    B = torch.randn(BATCH, LENGTH, HEADS, STATE, generator=generator, dtype=dtype)
    C = torch.randn(BATCH, LENGTH, HEADS, STATE, generator=generator, dtype=dtype)
    return x, dt, A, B, C


def test_segment_sums_are_the_log_decays_between_positions():
    values = torch.tensor([0.5, -1.0, 2.0, 0.25])
    sums = segment_sums(values)
    for i in range(4):
        for j in range(4):
            expected = values[j + 1:i + 1].sum() if j <= i else float("-inf")
            assert sums[i, j] == expected


@pytest.mark.parametrize("chunk_size", [1, 4, 8, 64])
def test_chunked_scan_equals_the_recurrence(chunk_size):
    inputs = _inputs()
    expected_y, expected_state = recurrence(*inputs)
    y, state = ssd_chunked_scan(*(t.float() for t in inputs), chunk_size)
    assert y.dtype == torch.float32
    # fp32 against float64: outputs of magnitude ~5 agree to ~1e-6.
    torch.testing.assert_close(y.double(), expected_y, rtol=0, atol=2e-6)
    torch.testing.assert_close(state.double(), expected_state, rtol=0, atol=2e-6)


def test_an_initial_state_continues_the_recurrence():
    x, dt, A, B, C = _inputs()
    half = LENGTH // 2
    _, first_state = recurrence(x[:, :half], dt[:, :half], A, B[:, :half], C[:, :half])
    expected_y, _ = recurrence(x, dt, A, B, C)
    y, _ = ssd_chunked_scan(x[:, half:], dt[:, half:], A, B[:, half:], C[:, half:], 8, initial_state=first_state)
    torch.testing.assert_close(y.double(), expected_y[:, half:], rtol=0, atol=2e-6)


def test_gradients_equal_the_recurrences():
    inputs = [t.requires_grad_() for t in _inputs()]
    weight = torch.randn(BATCH, LENGTH, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1),
                         dtype=torch.float64)
    (recurrence(*inputs)[0] * weight).sum().backward()
    expected = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    (ssd_chunked_scan(*inputs, 8)[0].double() * weight).sum().backward()
    for name, grad, reference in zip("x dt A B C".split(), (t.grad for t in inputs), expected):
        scale = reference.abs().max().clamp(min=1.0)
        assert ((grad - reference).abs().max() / scale) < 2e-6, name


@pytest.mark.gpu
def test_the_scan_on_a_cuda_device_equals_the_recurrence():
    """On a GPU the chunked scan (fp32, TF32 off) equals the float64 recurrence as on the CPU."""
    inputs = _inputs()
    expected_y, expected_state = recurrence(*inputs)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        y, state = ssd_chunked_scan(*(t.float().cuda() for t in inputs), 8)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    torch.testing.assert_close(y.double().cpu(), expected_y, rtol=0, atol=2e-6)
    torch.testing.assert_close(state.double().cpu(), expected_state, rtol=0, atol=2e-6)

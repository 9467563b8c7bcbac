"""vocab_parallel_cross_entropy against the cross entropy on the full vocabulary, forward and backward."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.tensor_parallel.tp_helpers import (
    assert_close,
    chunk,
    gather_partitions,
    setup_tensor_parallel,
    shared_randn,
)

SEQ, BATCH, VOCAB = 5, 3, 16


def _smoothed_target(target, label_smoothing):
    """Upstream Megatron's smoothed target: 1 - eps on the label, eps / (V - 1) on every other token."""
    one_hot = F.one_hot(target, VOCAB).float()
    return one_hot * (1.0 - label_smoothing) + (1.0 - one_hot) * label_smoothing / (VOCAB - 1)


def _reference(logits, target, upstream, label_smoothing):
    logits = logits.clone().requires_grad_()
    loss = -(_smoothed_target(target, label_smoothing) * F.log_softmax(logits, dim=-1)).sum(dim=-1)
    loss.backward(upstream)
    return loss.detach(), logits.grad


def _cross_entropy_matches_reference():
    _, rank, tp = setup_tensor_parallel()
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=torch.Generator().manual_seed(1))
    target[0] = torch.tensor([0, VOCAB - 1, VOCAB // tp])  # targets on partition edges
    upstream = shared_randn(SEQ, BATCH, seed=2)
    cases = [
        ("plain", 3.0 * shared_randn(SEQ, BATCH, VOCAB, seed=3), 0.0),
        ("label smoothing", shared_randn(SEQ, BATCH, VOCAB, seed=4), 0.1),
        # Large logits: exp() would overflow without subtracting the global maximum.
        ("large logits", shared_randn(SEQ, BATCH, VOCAB, seed=5) + 200.0, 0.0),
    ]
    for name, logits, label_smoothing in cases:
        expected_loss, expected_grad = _reference(logits, target, upstream, label_smoothing)
        local_logits = chunk(logits, -1, rank, tp).clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local_logits, target, label_smoothing=label_smoothing)
        assert loss.dtype == torch.float32 and loss.shape == target.shape
        tolerance = 1e-4 if name == "large logits" else 1e-5  # fp32 spacing near 200 is 1.5e-5
        torch.testing.assert_close(loss.detach(), expected_loss, atol=tolerance, rtol=1e-5, msg=name)
        loss.backward(upstream)
        assert_close(gather_partitions(local_logits.grad, -1), expected_grad, f"{name} logits grad")
    with pytest.raises(ValueError, match="logits shape"):
        vocab_parallel_cross_entropy(torch.zeros(SEQ, VOCAB // tp), target)
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_cross_entropy(world_size):
    assert run_on_ranks(world_size, _cross_entropy_matches_reference) == [True] * world_size


def test_single_rank_bf16_logits_return_fp32_loss_and_bf16_grad():
    logits = torch.randn(4, VOCAB).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, VOCAB, (4,))
    loss = vocab_parallel_cross_entropy(logits, target)
    assert loss.dtype == torch.float32
    expected = F.cross_entropy(logits.detach().float(), target, reduction="none")
    torch.testing.assert_close(loss.detach(), expected, atol=1e-5, rtol=1e-5)
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_label_smoothing_follows_upstream_on_one_rank():
    """Upstream's smoothing puts eps / (V - 1) on each non-label token (torch's puts eps / V on every token): with
    eps = 0.5 and V = 16 the loss of uniform logits is log(16) for either, but the gradient on the label is
    1/16 - 0.5 here against 1/16 - (1 - 0.5 + 0.5/16) in torch's convention."""
    logits = shared_randn(4, VOCAB, seed=6).requires_grad_()
    target = torch.tensor([0, 3, VOCAB - 1, 7])
    loss = vocab_parallel_cross_entropy(logits, target, label_smoothing=0.5)
    log_probs = torch.log_softmax(logits.detach(), dim=-1)
    on_label = log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    by_hand = -(0.5 * on_label + 0.5 / (VOCAB - 1) * (log_probs.sum(dim=-1) - on_label))
    torch.testing.assert_close(loss.detach(), by_hand, atol=1e-6, rtol=1e-6)
    loss.sum().backward()
    torch.testing.assert_close(logits.grad, log_probs.exp() - _smoothed_target(target, 0.5), atol=1e-6, rtol=1e-6)

    uniform = torch.zeros(1, VOCAB, requires_grad=True)
    loss = vocab_parallel_cross_entropy(uniform, torch.tensor([2]), label_smoothing=0.5)
    torch.testing.assert_close(loss.detach(), torch.tensor([torch.log(torch.tensor(16.0)).item()]))
    loss.sum().backward()
    torch.testing.assert_close(uniform.grad[0, 2], torch.tensor(1 / 16 - 0.5))


@pytest.mark.parametrize("label_smoothing", [-0.1, 1.0, 1.5])
def test_label_smoothing_outside_zero_one_is_refused(label_smoothing):
    """As the fused cross entropy and upstream (which asserts 0 < label_smoothing < 1): a negative value used to
    give the unsmoothed loss silently, 1.0 a target that ignores the label and more a loss pushing away from it."""
    with pytest.raises(ValueError, match=rf"label_smoothing must be in \[0, 1\), got {label_smoothing}"):
        vocab_parallel_cross_entropy(torch.zeros(2, VOCAB), torch.zeros(2, dtype=torch.long), label_smoothing)

"""The fused vocab-parallel cross entropy (--cross-entropy-loss-fusion) against the unfused one: loss and logits
gradient to 1e-6 on one rank and at TP=2, two collectives instead of three, no whole-size fp32 tensor saved for
backward, and a GPT model's loss and gradients with the flag against without it."""

import pytest
import torch
import torch.distributed as dist

from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.tensor_parallel.tp_helpers import chunk, setup_tensor_parallel, shared_randn

SEQ, BATCH, VOCAB = 6, 3, 32


def _loss_and_grad(function, logits, target, upstream, **kwargs):
    logits = logits.detach().clone().requires_grad_()
    loss = function(logits, target, **kwargs)
    loss.backward(upstream)
    return loss.detach(), logits.grad


def _targets(tp):
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=torch.Generator().manual_seed(1))
    target[0] = torch.tensor([0, VOCAB - 1, VOCAB // tp])  # targets on partition edges
    return target


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk_elements", [VOCAB, 5 * VOCAB, 1 << 22])  # one row, uneven chunks, all rows
def test_fused_equals_unfused_on_one_rank(label_smoothing, chunk_elements):
    logits = 4.0 * shared_randn(SEQ, BATCH, VOCAB, seed=3)
    target, upstream = _targets(1), shared_randn(SEQ, BATCH, seed=2)
    expected = _loss_and_grad(vocab_parallel_cross_entropy, logits, target, upstream,
                              label_smoothing=label_smoothing)
    actual = _loss_and_grad(fused_vocab_parallel_cross_entropy, logits, target, upstream,
                            label_smoothing=label_smoothing, chunk_elements=chunk_elements)
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_bf16_logits_stay_bf16_and_nothing_fp32_of_their_size_is_saved():
    logits = (4.0 * shared_randn(SEQ, BATCH, VOCAB, seed=3)).to(torch.bfloat16)
    target, upstream = _targets(1), shared_randn(SEQ, BATCH, seed=2)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, t.numel())) or t, lambda t: t):
        fused_loss, fused_grad = _loss_and_grad(fused_vocab_parallel_cross_entropy, logits, target, upstream,
                                                chunk_elements=2 * VOCAB)
    assert not [size for dtype, size in saved if dtype == torch.float32 and size >= logits.numel()]
    assert (torch.bfloat16, logits.numel()) in saved  # the logits themselves, for the recomputed softmax
    # The unfused path on the same values (upcast first, as the model does without the flag).
    loss, grad = _loss_and_grad(vocab_parallel_cross_entropy, logits.float(), target, upstream)
    assert fused_grad.dtype == torch.bfloat16
    torch.testing.assert_close(fused_loss, loss, atol=1e-6, rtol=1e-6)
    # The one difference: the fused gradient is rounded to bf16 (8 bits of mantissa) once.
    torch.testing.assert_close(fused_grad, grad.to(torch.bfloat16), atol=0, rtol=0)


def _torch_cross_entropy(logits, target):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1),
                                             reduction="none").reshape(target.shape)


def _fused_at_tp2():
    _, rank, tp = setup_tensor_parallel()
    logits = 4.0 * shared_randn(SEQ, BATCH, VOCAB, seed=3)
    target, upstream = _targets(tp), shared_randn(SEQ, BATCH, seed=2)
    local = chunk(logits, -1, rank, tp)
    counts = {}
    real_all_reduce = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        counts[current] = counts.get(current, 0) + 1
        return real_all_reduce(tensor, *args, **kwargs)

    results = {}
    dist.all_reduce = counting
    try:
        for current, function in (("unfused", vocab_parallel_cross_entropy),
                                  ("fused", fused_vocab_parallel_cross_entropy)):
            results[current] = _loss_and_grad(function, local, target, upstream)
    finally:
        dist.all_reduce = real_all_reduce
    full = _loss_and_grad(_torch_cross_entropy, logits, target, upstream)  # the whole vocabulary on one rank
    return {
        "counts": counts,
        "fused vs unfused": [float((a - b).abs().max()) for a, b in zip(results["fused"], results["unfused"])],
        "fused loss vs one rank": float((results["fused"][0] - full[0]).abs().max()),
        "fused grad vs one rank's slice": float((results["fused"][1] - chunk(full[1], -1, rank, tp)).abs().max()),
    }


def test_fused_at_tp2_uses_two_collectives_and_matches():
    for result in run_on_ranks(2, _fused_at_tp2):
        assert result["counts"] == {"unfused": 3, "fused": 2}
        assert max(result["fused vs unfused"]) <= 1e-6
        assert result["fused loss vs one rank"] <= 1e-6 and result["fused grad vs one rank's slice"] <= 1e-6


def test_gpt_loss_and_gradients_with_the_flag_equal_without():
    from tests.unit_tests.models.gpt.gpt_test_utils import fixed_batch, loss_and_grads, seeded_model, tiny_config

    batch = fixed_batch()
    plain_loss, plain_grads = loss_and_grads(seeded_model(tiny_config()), batch)
    fused_loss, fused_grads = loss_and_grads(seeded_model(tiny_config(cross_entropy_loss_fusion=True)), batch)
    torch.testing.assert_close(fused_loss, plain_loss, atol=1e-6, rtol=1e-6)
    assert fused_grads.keys() == plain_grads.keys()
    for name in plain_grads:
        torch.testing.assert_close(fused_grads[name], plain_grads[name], atol=1e-6, rtol=1e-6, msg=name)


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="logits shape"):
        fused_vocab_parallel_cross_entropy(torch.zeros(SEQ, VOCAB), torch.zeros(SEQ, BATCH, dtype=torch.long))
    with pytest.raises(ValueError, match="label_smoothing"):
        fused_vocab_parallel_cross_entropy(torch.zeros(2, VOCAB), torch.zeros(2, dtype=torch.long), 1.0)

"""The router's arithmetic against small hand-computed cases: top-k with each score function, scaling,
group-limited choice, expert bias, the aux-loss scores, capacity and token dropping."""

import math

import pytest
import torch

from megatron.core.transformer.moe.routing import apply_capacity, expert_capacity, scores_for_aux_loss, topk_routing


def _chosen(routing_map):
    return [sorted(row.nonzero().flatten().tolist()) for row in routing_map]


def test_softmax_topk_then_softmax_and_scaling():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    probs, routing_map = topk_routing(logits, 2)
    high = math.e / (math.e + 1)  # softmax over the chosen logits 3 and 2
    torch.testing.assert_close(probs, torch.tensor([[0.0, high, 1 - high, 0.0]]), rtol=0, atol=1e-7)
    assert _chosen(routing_map) == [[1, 2]]
    scaled, _ = topk_routing(logits, 2, scaling_factor=2.5)
    torch.testing.assert_close(scaled, 2.5 * probs, rtol=0, atol=1e-7)


def test_pre_softmax_keeps_the_full_softmax():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    probs, _ = topk_routing(logits, 2, pre_softmax=True)
    denominator = sum(math.exp(v) for v in (1.0, 3.0, 2.0, 0.0))
    expected = torch.tensor([[0.0, math.exp(3.0) / denominator, math.exp(2.0) / denominator, 0.0]])
    torch.testing.assert_close(probs, expected, rtol=0, atol=1e-7)


def test_sigmoid_normalised_and_expert_bias_chooses_only():
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0]])
    s = torch.sigmoid(logits)[0]
    probs, routing_map = topk_routing(logits, 2, score_function="sigmoid")
    assert _chosen(routing_map) == [[1, 3]]
    torch.testing.assert_close(probs[0, [1, 3]], torch.stack([s[1], s[3]]) / (s[1] + s[3]), rtol=0, atol=1e-7)
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0])  # lifts expert 2 above expert 3 for the choice only
    probs, routing_map = topk_routing(logits, 2, score_function="sigmoid", expert_bias=bias)
    assert _chosen(routing_map) == [[1, 2]]
    torch.testing.assert_close(probs[0, [1, 2]], torch.stack([s[1], s[2]]) / (s[1] + s[2]), rtol=0, atol=1e-7)
    single, _ = topk_routing(logits, 1, score_function="sigmoid")
    torch.testing.assert_close(single[0, 1], s[1], rtol=0, atol=0)  # k = 1: no normalisation


def test_expert_bias_chooses_in_fp32_with_bf16_scores():
    """A bf16 router (the default under --bf16) adds the fp32 expert bias in fp32, as upstream: the bias's
    1e-3 steps are below bf16's spacing at 0.5 and would be rounded away."""
    logits = torch.zeros(2, 4, dtype=torch.bfloat16)  # every sigmoid score is 0.5
    probs, routing_map = topk_routing(logits, 1, score_function="sigmoid",
                                      expert_bias=torch.tensor([0.0, 0.001, 0.0, 0.0]))
    assert _chosen(routing_map) == [[1], [1]] and probs.dtype == torch.bfloat16
    bias = torch.tensor([0.0, 0.001, 0.0, 0.002])
    _, routing_map = topk_routing(logits, 2, score_function="sigmoid", expert_bias=bias, num_groups=2, group_topk=1)
    assert _chosen(routing_map) == [[2, 3], [2, 3]]  # group {2, 3} scores 0.502 + 0.5 > group {0, 1}


def test_aux_loss_softmax_in_fp32_for_a_bf16_router():
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(1)).bfloat16()
    scores, routing_map = scores_for_aux_loss(logits, 2, "softmax")
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, torch.softmax(logits.float(), dim=-1), rtol=0, atol=0)
    assert routing_map.sum(dim=1).tolist() == [2] * 6
    assert scores_for_aux_loss(logits.double(), 2, "softmax")[0].dtype == torch.float64


def _sqrtsoftplus(values):
    return torch.tensor([math.sqrt(math.log1p(math.exp(value))) for value in values])


def test_sqrtsoftplus_normalised_and_expert_bias_chooses_only():
    values = [0.0, 2.0, -1.0, 1.0]
    logits, s = torch.tensor([values]), _sqrtsoftplus(values)
    probs, routing_map = topk_routing(logits, 2, score_function="sqrtsoftplus")
    assert _chosen(routing_map) == [[1, 3]]
    expected = torch.tensor([[0.0, s[1] / (s[1] + s[3]), 0.0, s[3] / (s[1] + s[3])]])
    torch.testing.assert_close(probs, expected, rtol=0, atol=1e-7)
    scaled, _ = topk_routing(logits, 2, score_function="sqrtsoftplus", scaling_factor=2.5)
    torch.testing.assert_close(scaled, 2.5 * expected, rtol=0, atol=1e-7)
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0])  # s = 0.83, 1.46, 0.56, 1.15: lifts expert 2 above expert 3
    probs, routing_map = topk_routing(logits, 2, score_function="sqrtsoftplus", expert_bias=bias)
    assert _chosen(routing_map) == [[1, 2]]
    torch.testing.assert_close(probs[0, [1, 2]], torch.stack([s[1], s[2]]) / (s[1] + s[2]), rtol=0, atol=1e-7)
    single, _ = topk_routing(logits, 1, score_function="sqrtsoftplus")
    torch.testing.assert_close(single[0], torch.tensor([0.0, s[1], 0.0, 0.0]), rtol=0, atol=1e-7)  # k = 1: as is


def test_sqrtsoftplus_group_limited_with_and_without_expert_bias():
    # Six experts in three groups of two; sqrt(softplus) of [5, 0 | 3, 3.1 | 4, 1] = [2.24, 0.83 | 1.75, 1.77 |
    # 2.00, 1.15]. Plain top-2: experts 0 and 4.
    values = [5.0, 0.0, 3.0, 3.1, 4.0, 1.0]
    logits, s = torch.tensor([values]), _sqrtsoftplus(values)
    _, plain = topk_routing(logits, 2, score_function="sqrtsoftplus")
    assert _chosen(plain) == [[0, 4]]
    # One group, scored by the sum of its two scores: 3.07, 3.52, 3.15 -> the middle group.
    probs, routing_map = topk_routing(logits, 2, score_function="sqrtsoftplus", num_groups=3, group_topk=1)
    assert _chosen(routing_map) == [[2, 3]]
    torch.testing.assert_close(probs[0, [2, 3]], torch.stack([s[2], s[3]]) / (s[2] + s[3]), rtol=0, atol=1e-7)
    # A bias of 1 on expert 5 makes the last group's sum 4.15: it wins the choice, the probabilities stay unbiased.
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    probs, routing_map = topk_routing(logits, 2, score_function="sqrtsoftplus", num_groups=3, group_topk=1,
                                      expert_bias=bias)
    assert _chosen(routing_map) == [[4, 5]]
    torch.testing.assert_close(probs[0, [4, 5]], torch.stack([s[4], s[5]]) / (s[4] + s[5]), rtol=0, atol=1e-7)
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-7)


def test_sqrtsoftplus_aux_loss_scores_normalised_over_all_experts():
    values = [0.5, -2.0, 1.5, 0.0]
    s = _sqrtsoftplus(values)
    scores, aux_map = scores_for_aux_loss(torch.tensor([values]), 2, "sqrtsoftplus")
    torch.testing.assert_close(scores[0], s / s.sum(), rtol=0, atol=1e-7)
    assert _chosen(aux_map) == [[0, 2]]


def test_group_limited_routing():
    # Six experts in three groups of two: [5, 0 | 3, 3 | 4, 1].
    logits = torch.tensor([[5.0, 0.0, 3.0, 3.1, 4.0, 1.0]])
    _, plain = topk_routing(logits, 2)
    assert _chosen(plain) == [[0, 4]]
    # One group, scored by the sum of its best k // 1 = 2 experts: 5, 6.1, 5 -> the middle group.
    _, one_group = topk_routing(logits, 2, num_groups=3, group_topk=1)
    assert _chosen(one_group) == [[2, 3]]
    # Two groups, each scored by its best expert (k // 2 = 1): 5, 3.1, 4 -> groups 0 and 2.
    _, two_groups = topk_routing(logits, 2, num_groups=3, group_topk=2)
    assert _chosen(two_groups) == [[0, 4]]
    probs, _ = topk_routing(logits, 2, num_groups=3, group_topk=1)
    high = 1 / (1 + math.exp(-0.1))
    torch.testing.assert_close(probs[0, [2, 3]], torch.tensor([1 - high, high]), rtol=0, atol=1e-7)


def test_capacity_and_drop_policies():
    assert expert_capacity(num_tokens=4, topk=1, num_experts=2, capacity_factor=1.0) == 2
    assert expert_capacity(num_tokens=5, topk=2, num_experts=4, capacity_factor=1.5) == 4  # ceil(3.75)
    assert expert_capacity(num_tokens=3, topk=2, num_experts=2, capacity_factor=4.0) == 3  # at most the tokens
    # Tokens 0, 1, 2 chose expert 0 (probabilities 0.6, 0.9, 0.7); token 3 chose expert 1 (0.8). Capacity 2.
    probs = torch.tensor([[0.6, 0.0], [0.9, 0.0], [0.7, 0.0], [0.0, 0.8]])
    routing_map = probs > 0
    kept_probs, kept = apply_capacity(probs, routing_map, 2, "probs")
    assert kept[:, 0].tolist() == [False, True, True, False]  # the least likely token (0) is dropped
    assert kept[:, 1].tolist() == [False, False, False, True]
    torch.testing.assert_close(kept_probs, probs * kept)
    _, kept = apply_capacity(probs, routing_map, 2, "position")
    assert kept[:, 0].tolist() == [True, True, False, False]  # the latest token (2) is dropped
    padded_probs, padded = apply_capacity(probs, routing_map, 2, "probs", pad_to_capacity=True)
    assert padded.sum(dim=0).tolist() == [2, 2]  # exactly capacity slots per expert
    assert padded[:, 1].tolist() == [True, False, False, True]  # the spare slot: earliest unrouted token
    assert padded_probs[0, 1].item() == 0.0
    _, padded = apply_capacity(probs, routing_map, 2, "position", pad_to_capacity=True)
    assert padded[:, 1].tolist() == [True, False, False, True]

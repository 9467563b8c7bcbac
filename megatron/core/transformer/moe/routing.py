"""The router's arithmetic on one rank's tokens: scores, top-k choice (plain or group-limited), the routing
probabilities, and expert capacity with token dropping. Pure functions of tensors `[tokens, experts]`.

Ties between equal scores are broken by torch.topk; the capacity cut sorts stably, so of two tokens with equal
keys the earlier one is kept.
"""

import math

import torch
import torch.nn.functional as F

_NORMALISATION_EPS = 1e-20


def independent_scores(logits, score_function):
    """Scores each expert gets on its own, not competing in a softmax: sigmoid(logits), or
    sqrt(softplus(logits)) for `sqrtsoftplus`. Routing chooses among them and normalises the chosen ones."""
    if score_function == "sigmoid":
        return torch.sigmoid(logits)
    if score_function == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    raise ValueError(f"--moe-router-score-function must be softmax, sigmoid or sqrtsoftplus, got {score_function!r}")


def group_limited_topk(scores, topk, num_groups, group_topk):
    """Top-k among the experts of the `group_topk` best groups; a group's score is the sum of its best
    `topk // group_topk` expert scores. Returns (chosen scores, indices) like torch.topk."""
    num_tokens, num_experts = scores.shape
    per_group = scores.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = per_group.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    chosen_groups = group_scores.topk(group_topk, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen_groups, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(per_group).reshape(num_tokens, num_experts)
    return scores.masked_fill(~expert_mask, float("-inf")).topk(topk, dim=-1)


def _topk(scores, topk, num_groups, group_topk):
    if group_topk:
        return group_limited_topk(scores, topk, num_groups, group_topk)
    return scores.topk(topk, dim=-1)


def topk_routing(logits, topk, score_function="softmax", pre_softmax=False, scaling_factor=None, num_groups=None,
                 group_topk=None, expert_bias=None):
    """(probs [tokens, E] with zeros off the chosen experts, routing_map [tokens, E] bool).

    softmax: top-k of the logits, softmax over those k (`pre_softmax`: softmax over all E, then top-k).
    sigmoid / sqrtsoftplus: s = sigmoid(logits) / sqrt(softplus(logits)); the top-k of s + `expert_bias` (the
    bias only chooses); the chosen s are normalised to sum to 1 when k > 1. `scaling_factor` multiplies the
    probabilities last.
    """
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1)
            probs, indices = _topk(scores, topk, num_groups, group_topk)
        else:
            chosen_logits, indices = _topk(logits, topk, num_groups, group_topk)
            probs = torch.softmax(chosen_logits, dim=-1)
    else:
        scores = independent_scores(logits, score_function)
        if expert_bias is not None:
            # In the wider of the two dtypes (as upstream's type promotion): a bf16 sum would round away the
            # bias's steps of --moe-router-bias-update-rate.
            _, indices = _topk(scores + expert_bias, topk, num_groups, group_topk)
            probs = scores.gather(1, indices)
        else:
            probs, indices = _topk(scores, topk, num_groups, group_topk)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + _NORMALISATION_EPS)
    if scaling_factor:
        probs = probs * scaling_factor
    dense_probs = torch.zeros_like(logits).scatter(1, indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return dense_probs, routing_map


def scores_for_aux_loss(logits, topk, score_function):
    """(scores over all E, their own top-k map) on which the load-balancing losses are computed: the softmax,
    or the sigmoid / sqrtsoftplus scores normalised to sum to 1, of every expert. The softmax is taken in fp32 at
    least, as upstream: a bf16 router's losses are computed, logged and differentiated in fp32."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    else:
        scores = independent_scores(logits, score_function)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + _NORMALISATION_EPS)
    indices = scores.topk(topk, dim=-1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return scores, routing_map


def expert_capacity(num_tokens, topk, num_experts, capacity_factor):
    """Tokens one expert takes on this rank: ceil(tokens * k / E * factor), at least 1, at most `num_tokens`."""
    capacity = math.ceil(num_tokens * topk / num_experts * capacity_factor)
    return max(1, min(capacity, num_tokens))


def apply_capacity(probs, routing_map, capacity, drop_policy="probs", pad_to_capacity=False):
    """(probs, routing_map) with each expert keeping at most `capacity` tokens.

    `probs`: the highest-probability tokens stay; `position`: the earliest. With `pad_to_capacity` every expert
    gets exactly `capacity` slots, the spare ones filled by tokens not routed to it (probability 0).
    """
    if drop_policy == "probs":
        keys = probs.detach()
    elif drop_policy == "position":
        keys = routing_map.to(probs.dtype)
    else:
        raise ValueError(f"--moe-token-drop-policy must be probs or position, got {drop_policy!r}")
    order = torch.sort(keys, dim=0, descending=True, stable=True).indices
    kept_slots = torch.zeros_like(routing_map)
    kept_slots[: capacity] = True
    capacity_mask = torch.zeros_like(routing_map).scatter(0, order, kept_slots)
    final_map = capacity_mask if pad_to_capacity else capacity_mask & routing_map
    return probs * final_map, final_map


def pad_routing_map(probs, routing_map, multiple):
    """(probs, routing_map) with each expert's token count raised to a multiple of `multiple` (at most every
    token) by routing to it the earliest tokens not yet routed to it, with probability 0: the combined output is
    unchanged, the experts' GEMMs get aligned row counts (`--moe-router-padding-for-fp8`)."""
    num_tokens = routing_map.size(0)
    counts = routing_map.sum(dim=0)
    target = torch.clamp((counts + multiple - 1) // multiple * multiple, max=num_tokens)
    unrouted = ~routing_map
    position_among_unrouted = torch.cumsum(unrouted.to(torch.int64), dim=0)  # 1-based where unrouted
    padding = unrouted & (position_among_unrouted <= (target - counts).unsqueeze(0))
    return probs.masked_fill(padding, 0.0), routing_map | padding

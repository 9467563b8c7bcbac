"""Choosing the next token from the logits of the last position (see `SamplingParams` for the rules).

Pure tensor functions on `[batch, vocab]` logits: no process group. Sampling draws from an explicit
`torch.Generator`, so a generation is reproducible for a given seed.
"""

import dataclasses
import sys

import torch

from megatron.core.inference.sampling_params import SamplingParams


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """`logits` with all but the `k` largest of each row set to -inf (exactly k kept; among equal logits, the
    lowest ids)."""
    if k > logits.shape[-1]:
        raise ValueError(f"--top_k {k} exceeds the vocabulary size {logits.shape[-1]}")
    largest = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :k]  # lowest ids first on ties
    kept = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, largest, True)
    return logits.masked_fill(~kept, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """`logits` with every token outside the nucleus set to -inf: the nucleus is the smallest set of most likely
    tokens whose probabilities sum to at least `p` (a token is kept when the tokens more likely than it sum to
    less than `p`; the most likely token is always kept)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits.float(), dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    kept_sorted = mass_before < p
    kept_sorted[..., 0] = True
    kept = torch.zeros_like(kept_sorted).scatter_(-1, order, kept_sorted)
    return logits.masked_fill(~kept, float("-inf"))


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 logits divided by the temperature, then top-k or top-p filtered: their softmax is the distribution
    a token is drawn from (not used for greedy decoding)."""
    logits = logits.float() / params.temperature
    if params.top_k > 1:
        return top_k_filter(logits, params.top_k)
    if params.top_p > 0.0:
        return top_p_filter(logits, params.top_p)
    return logits


def sample_next_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """`[batch, vocab]` logits -> `[batch]` token ids: the argmax for greedy decoding (the lowest id among
    ties), else one draw from `softmax(filtered_logits(logits, params))` per row."""
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    probs = torch.softmax(filtered_logits(logits, params), dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def params_for_next_step(params: SamplingParams) -> SamplingParams:
    """The params the next token is chosen with, as upstream's generation loop updates them after each step: with
    `top_p > 0` and `top_p_decay > 0`, `top_p <- max(top_p * top_p_decay, top_p_bound)`; otherwise unchanged."""
    if params.top_p == 0.0 or params.top_p_decay == 0.0:
        return params
    top_p = max(params.top_p * params.top_p_decay, params.top_p_bound)
    # Without a bound the product underflows to 0 after some 1000 halvings, and a top_p of 0 would turn nucleus
    # sampling off; the smallest positive top_p keeps what a vanishing one keeps: the most likely token.
    return dataclasses.replace(params, top_p=top_p if top_p > 0.0 else sys.float_info.min)

"""Choosing the next token: temperature, top-k and top-p filtering against hand-computed distributions, greedy
ties, reproducible draws, the top_p decay schedule, and the sampling flags' validation."""

import math

import pytest
import torch

from megatron.core.inference.sampling import (
    filtered_logits,
    params_for_next_step,
    sample_next_tokens,
    top_k_filter,
    top_p_filter,
)
from megatron.core.inference.sampling_params import SamplingParams

INF = float("inf")


def _probs(logits):
    return torch.softmax(logits, dim=-1)


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [5.0, 5.0, 5.0, -1.0]])
    filtered = top_k_filter(logits, 2)
    assert filtered.tolist() == [[-INF, 3.0, 2.0, -INF], [5.0, 5.0, -INF, -INF]]
    # softmax over the two survivors: e^3 / (e^3 + e^2) = 1 / (1 + e^-1)
    expected = 1 / (1 + math.exp(-1))
    torch.testing.assert_close(_probs(filtered)[0], torch.tensor([0.0, expected, 1 - expected, 0.0]))
    with pytest.raises(ValueError, match="--top_k 5 exceeds the vocabulary size 4"):
        top_k_filter(logits, 5)


@pytest.mark.parametrize("top_p, kept", [(0.45, [0]), (0.6, [0, 1]), (0.81, [0, 1, 2]), (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    # Probabilities 0.5, 0.3, 0.15, 0.05, shuffled in the vocabulary.
    probs = {2: 0.5, 0: 0.3, 3: 0.15, 1: 0.05}
    logits = torch.log(torch.tensor([[probs[token] for token in range(4)]]))
    by_rank = [2, 0, 3, 1]
    kept_ids = sorted(by_rank[rank] for rank in kept)
    filtered = _probs(top_p_filter(logits, top_p))[0]
    mass = sum(probs[token] for token in kept_ids)
    expected = torch.tensor([probs[token] / mass if token in kept_ids else 0.0 for token in range(4)])
    torch.testing.assert_close(filtered, expected)


def test_temperature_divides_the_logits_before_filtering():
    logits = torch.tensor([[0.0, math.log(2.0), -1e3]])
    # T = 0.5: weights 1, 2^2 = 4 -> 0.2, 0.8
    params = SamplingParams(temperature=0.5, top_k=0)
    torch.testing.assert_close(_probs(filtered_logits(logits, params))[0], torch.tensor([0.2, 0.8, 0.0]))
    # T = 2 then top-2: weights 1, sqrt(2) over the two survivors
    params = SamplingParams(temperature=2.0, top_k=2)
    root = math.sqrt(2.0)
    torch.testing.assert_close(_probs(filtered_logits(logits, params))[0],
                               torch.tensor([1 / (1 + root), root / (1 + root), 0.0]))


def test_greedy_takes_the_argmax_lowest_id_on_ties():
    logits = torch.tensor([[0.1, 2.0, 2.0, -3.0], [4.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(top_k=1, temperature=0.01)
    assert sample_next_tokens(logits, params, torch.Generator().manual_seed(0)).tolist() == [1, 0]
    # As upstream's, greedy decoding never divides by the temperature: 0 is accepted there, and only there.
    params = SamplingParams(top_k=1, temperature=0.0)
    assert sample_next_tokens(logits, params, torch.Generator().manual_seed(0)).tolist() == [1, 0]
    with pytest.raises(ValueError, match=r"--temperature must be > 0, got 0.0 \(use --top_k 1 for greedy decoding"):
        SamplingParams(top_k=2, temperature=0.0)


def test_draws_stay_in_the_filtered_set_and_repeat_for_a_seed():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(4000, 4)
    params = SamplingParams(top_p=0.6)
    first = sample_next_tokens(logits, params, torch.Generator().manual_seed(5))
    again = sample_next_tokens(logits, params, torch.Generator().manual_seed(5))
    assert torch.equal(first, again)
    counts = torch.bincount(first, minlength=4).tolist()
    assert counts[2] == counts[3] == 0
    assert abs(counts[0] / 4000 - 0.5 / 0.8) < 0.03  # 0.625 of the draws, binomial sd ~0.008


@pytest.mark.parametrize("kwargs, flag", [
    (dict(temperature=0.0), "--temperature"),
    (dict(top_k=-1), "--top_k"),
    (dict(top_p=1.5), "--top_p"),
    (dict(top_k=4, top_p=0.5), "--top_k 4 and --top_p 0.5"),
    (dict(num_tokens_to_generate=0), "--num-tokens-to-generate"),
    (dict(top_p_decay=0.5), "top_p_decay cannot be set without top_p"),
    (dict(top_p_bound=0.1), "top_p_bound cannot be set without top_p"),
    (dict(top_p=0.5, top_p_decay=1.5), "top_p_decay must be in"),
    (dict(top_p=0.5, top_p_bound=0.6), "top_p_bound must be in"),
])
def test_bad_sampling_flags_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        SamplingParams(**kwargs)


def _top_p_schedule(params, steps):
    schedule = []
    for _ in range(steps):
        schedule.append(params.top_p)
        params = params_for_next_step(params)
    return schedule


def test_top_p_decays_each_step_down_to_its_bound():
    # max(top_p * decay, bound) by hand: 0.9, 0.45, 0.225, then 0.1125 < 0.2 stays at the bound.
    params = SamplingParams(top_p=0.9, top_p_decay=0.5, top_p_bound=0.2)
    assert _top_p_schedule(params, 5) == pytest.approx([0.9, 0.45, 0.225, 0.2, 0.2], abs=1e-15)
    # No bound: 0.8 * 0.25^k.
    assert _top_p_schedule(SamplingParams(top_p=0.8, top_p_decay=0.25), 4) == \
        pytest.approx([0.8, 0.2, 0.05, 0.0125], abs=1e-15)
    # Decay 0 (upstream's default) or top_p 0 leaves the params as they are.
    for fixed in (SamplingParams(top_p=0.7, top_p_bound=0.3), SamplingParams(top_k=0)):
        assert params_for_next_step(fixed) is fixed
    # A product that underflows keeps nucleus sampling on (only the most likely token) instead of turning it off.
    tiny = params_for_next_step(SamplingParams(top_p=1e-300, top_p_decay=1e-300))
    assert 0.0 < tiny.top_p < 1e-300
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    assert filtered_logits(logits, tiny).isfinite().tolist() == [[True, False, False]]

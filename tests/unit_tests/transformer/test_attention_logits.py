"""The per-head maximum attention logit that --qk-clip and --log-max-attention-logit track: equal to a hand
computation (causal, explicit mask, grouped queries), exact under context parallelism after a MAX over its ranks,
and tracked by `SelfAttention` without changing the attention's output."""

import math

import pytest
import torch
import torch.distributed as dist

from megatron.core.transformer.attention_logits import context_parallel_max_attention_logits, max_attention_logits
from tests.unit_tests.multiprocess_harness import run_on_ranks

SEQ, BATCH, HEADS, GROUPS, HEAD_DIM = 8, 2, 4, 2, 4


def _query_key(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, generator=generator),
            torch.randn(SEQ, BATCH, GROUPS, HEAD_DIM, generator=generator))


def _by_hand(query, key, blocked):
    """max over b, i, j not blocked of q[i, b, h] . k[j, b, h // (H / G)] / sqrt(d), one product at a time."""
    heads, groups = query.shape[2], key.shape[2]
    maxima = []
    for head in range(heads):
        best = -math.inf
        for batch in range(query.shape[1]):
            for i in range(query.shape[0]):
                for j in range(key.shape[0]):
                    if not blocked(batch, head, i, j):
                        dot = sum(query[i, batch, head, c].item() * key[j, batch, head // (heads // groups), c].item()
                                  for c in range(query.shape[3]))
                        best = max(best, dot / math.sqrt(query.shape[3]))
        maxima.append(best)
    return torch.tensor(maxima)


def test_causal_maximum_equals_a_hand_computation():
    query, key = _query_key()
    expected = _by_hand(query, key, lambda b, h, i, j: j > i)
    torch.testing.assert_close(max_attention_logits(query, key), expected, atol=1e-5, rtol=1e-5)
    # The unmasked maximum is larger for some head: the causal mask is honoured.
    everything = _by_hand(query, key, lambda b, h, i, j: False)
    assert (everything > expected + 1e-3).any()


def test_explicit_mask_per_batch_and_head():
    query, key = _query_key(seed=1)
    generator = torch.Generator().manual_seed(2)
    mask = torch.rand(BATCH, HEADS, SEQ, SEQ, generator=generator) < 0.6  # True: not allowed
    expected = _by_hand(query, key, lambda b, h, i, j: bool(mask[b, h, i, j]))
    torch.testing.assert_close(max_attention_logits(query, key, mask), expected, atol=1e-5, rtol=1e-5)
    shared = mask[:, :1]  # one mask for all heads, [b, 1, s, s]
    expected = _by_hand(query, key, lambda b, h, i, j: bool(shared[b, 0, i, j]))
    torch.testing.assert_close(max_attention_logits(query, key, shared), expected, atol=1e-5, rtol=1e-5)


def _context_parallel_maxima(with_mask):
    from megatron.core.transformer.context_parallel.sequence_split import local_rows

    query, key = _query_key(seed=3)
    mask = None
    if with_mask:
        mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1) | (torch.rand(BATCH, 1, 1, SEQ) < 0.3)
        mask = mask & ~torch.eye(SEQ, dtype=torch.bool)
    size, rank = dist.get_world_size(), dist.get_rank()
    local = context_parallel_max_attention_logits(local_rows(query, 0, size, rank), local_rows(key, 0, size, rank),
                                                  mask, dist.group.WORLD)
    reduced = local.clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
    return local, reduced, max_attention_logits(query, key, mask)


@pytest.mark.parametrize("with_mask", [False, True])
def test_context_parallel_maximum_is_the_full_one(with_mask):
    results = run_on_ranks(2, _context_parallel_maxima, with_mask)
    for local, reduced, full in results:
        torch.testing.assert_close(reduced, full, atol=1e-6, rtol=1e-6)
    # Each rank alone sees a part of the logits: the MAX over ranks is needed.
    assert not torch.equal(results[0][0], results[1][0])


def test_self_attention_tracks_without_changing_its_output():
    from megatron.core import tensor_parallel
    from megatron.core.transformer.attention import SelfAttention
    from tests.unit_tests.models.gpt.gpt_test_utils import tiny_config

    outputs, modules = [], []
    hidden = torch.randn(SEQ, BATCH, 32, generator=torch.Generator().manual_seed(4))
    for tracked in (False, True):
        tensor_parallel.model_parallel_cuda_manual_seed(5)
        attention = SelfAttention(tiny_config(num_query_groups=GROUPS, log_max_attention_logit=tracked), 1)
        outputs.append(attention(hidden)[0])
        modules.append(attention)
    assert torch.equal(outputs[0], outputs[1])
    assert modules[0].max_attention_logits is None
    # The logits of the module's own queries and keys: recompute them from its QKV projection.
    attention = modules[1]

    def logits_of(states):
        mixed = attention.linear_qkv(states)[0].view(SEQ, BATCH, GROUPS, -1)
        query, key, _ = torch.split(mixed, [2 * 8, 8, 8], dim=-1)
        return max_attention_logits(query.reshape(SEQ, BATCH, HEADS, 8), key)

    first = logits_of(hidden)
    torch.testing.assert_close(attention.max_attention_logits, first)
    other = torch.randn(SEQ, BATCH, 32, generator=torch.Generator().manual_seed(6))
    attention(other)  # a second microbatch: the tracked maxima are over both
    torch.testing.assert_close(attention.max_attention_logits, torch.maximum(first, logits_of(other)))
    assert not torch.equal(first, logits_of(other))
    attention.eval()
    attention.max_attention_logits = None
    attention(hidden)
    assert attention.max_attention_logits is None  # evaluation forwards are not tracked


def test_blocks_of_query_rows_give_the_same_maxima(monkeypatch):
    from megatron.core.transformer import attention_logits

    query, key = _query_key(seed=7)
    padding = torch.rand(BATCH, 1, 1, SEQ, generator=torch.Generator().manual_seed(8)) < 0.4
    per_head = torch.rand(BATCH, HEADS, SEQ, SEQ, generator=torch.Generator().manual_seed(9)) < 0.5
    whole = [max_attention_logits(query, key, mask) for mask in (None, padding, per_head)]
    # Three query rows per block (of 8): blocks of unequal size, the causal mask cut along its rows.
    monkeypatch.setattr(attention_logits, "MAX_SCORES_PER_BLOCK", BATCH * (HEADS // GROUPS) * SEQ * 3)
    for mask, expected in zip((None, padding, per_head), whole):
        assert torch.equal(max_attention_logits(query, key, mask), expected)
    expected = _by_hand(query, key, lambda b, h, i, j: bool(padding[b, 0, 0, j]))
    torch.testing.assert_close(whole[1], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute_measures_each_forward_once(monkeypatch, granularity):
    from megatron.core.optimizer.qk_clip import attention_modules
    from megatron.core.transformer import attention as attention_module
    from tests.unit_tests.models.gpt.gpt_test_utils import fixed_batch, seeded_model, tiny_config

    measured = []

    def counting(query, key, attention_mask=None, scale=None):
        measured.append(query.shape)
        return max_attention_logits(query, key, attention_mask, scale)

    monkeypatch.setattr(attention_module, "max_attention_logits", counting)
    tokens, labels, position_ids = fixed_batch()
    maxima = []
    recompute = dict(recompute_granularity=granularity)
    if granularity == "full":
        recompute.update(recompute_method="uniform", recompute_num_layers=1)
    for recompute in ({}, recompute):
        model = seeded_model(tiny_config(num_query_groups=GROUPS, log_max_attention_logit=True, **recompute))
        measured.clear()
        model(tokens, position_ids, labels=labels).sum().backward()
        assert len(measured) == 2, (recompute, len(measured))  # one per layer, none again in the recompute
        maxima.append([attention.max_attention_logits for attention in attention_modules([model])])
    for plain, recomputed in zip(*maxima):
        assert torch.equal(plain, recomputed)

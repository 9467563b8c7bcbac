"""The static-batch key/value cache (`InferenceParams` / `StaticInferenceContext`): decoding one position at a
time through the cache gives causal attention over the whole sequence; offsets, beam reordering and reset."""

import math

import pytest
import torch

from megatron.core import InferenceParams
from megatron.core.inference.contexts import StaticInferenceContext

SEQ, BATCH, GROUPS, HEAD_DIM = 6, 3, 2, 4


def _qkv(seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(SEQ, BATCH, GROUPS, HEAD_DIM, generator=generator) for _ in range(3)]


def _attention(query, keys, values, causal_offset=0):
    """softmax(q k^T / sqrt(d)) v per batch row and group, `[sq, b, g, d]`; query i sees keys <= i + offset."""
    scores = torch.einsum("sbgd,tbgd->bgst", query, keys) / math.sqrt(HEAD_DIM)
    allowed = torch.arange(keys.shape[0])[None, :] <= torch.arange(query.shape[0])[:, None] + causal_offset
    probabilities = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("bgst,tbgd->sbgd", probabilities, values)


def test_inference_params_is_the_static_context():
    params = InferenceParams(max_batch_size=BATCH, max_sequence_length=SEQ)
    assert isinstance(params, StaticInferenceContext) and params.is_static_batching()
    assert (params.sequence_len_offset, params.batch_size_offset, params.current_batch_size) == (0, 0, BATCH)


def test_prefill_then_decode_through_the_cache_equals_full_causal_attention():
    query, key, value = _qkv(0)
    expected = _attention(query, key, value)
    context = InferenceParams(BATCH, SEQ)
    prompt = 3
    keys, values = context.append_key_value(1, key[:prompt], value[:prompt])
    outputs = [_attention(query[:prompt], keys, values)]
    context.increment_sequence_len_offset(prompt)
    context.enable_decode_mode()
    for position in range(prompt, SEQ):
        keys, values = context.append_key_value(1, key[position:position + 1], value[position:position + 1])
        assert keys.shape[0] == position + 1
        outputs.append(_attention(query[position:position + 1], keys, values, causal_offset=position))
        context.increment_sequence_len_offset(1)
    torch.testing.assert_close(torch.cat(outputs), expected, atol=1e-6, rtol=1e-6)
    assert context.is_decode_only() and context.sequence_len_offset == SEQ
    with pytest.raises(ValueError, match="max_sequence_length"):
        context.increment_sequence_len_offset(1)


def test_swap_reorders_cached_sequences_and_reset_starts_over():
    _, key, value = _qkv(1)
    context = InferenceParams(BATCH, SEQ)
    context.append_key_value(2, key[:2], value[:2])
    context.swap_key_value_dict([2, 0, 1])
    key_cache, value_cache = context.key_value_memory_dict[2]
    torch.testing.assert_close(key_cache[:2], key[:2][:, [2, 0, 1]], atol=0, rtol=0)
    torch.testing.assert_close(value_cache[:2], value[:2][:, [2, 0, 1]], atol=0, rtol=0)
    context.increment_sequence_len_offset(2)
    context.enable_decode_mode()
    context.reset()
    assert (context.sequence_len_offset, context.batch_size_offset, context.decode_mode) == (0, 0, False)
    with pytest.raises(ValueError, match="batch_idx"):
        context.swap_key_value_dict(list(range(BATCH + 1)))


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="max_batch_size"):
        InferenceParams(0, SEQ)
    context = InferenceParams(BATCH, 2)
    _, key, value = _qkv(2)
    with pytest.raises(ValueError, match="exceed"):
        context.append_key_value(1, key[:3], value[:3])
    with pytest.raises(ValueError, match="empty"):
        InferenceParams(BATCH, SEQ).swap_key_value_dict([0])


def test_micro_batches_of_rows_fill_the_cache_as_one_batch():
    # Upstream's pipelined decoding runs a step's rows as micro-batches: rows 0-1, then row 2.
    query, key, value = _qkv(3)
    expected = _attention(query, key, value)
    context = StaticInferenceContext(BATCH, SEQ)
    assert not context.is_dynamic_batching()
    outputs, steps = [], [(0, 3)] + [(position, position + 1) for position in range(3, SEQ)]
    for start, end in steps:
        step_rows = []
        for rows in (slice(0, 2), slice(2, 3)):
            keys, values = context.append_key_value(1, key[start:end, rows], value[start:end, rows])
            step_rows.append(_attention(query[start:end, rows], keys, values, causal_offset=start))
            context.increment_batch_size_offset(rows.stop - rows.start)
        with pytest.raises(ValueError, match="batch rows past max_batch_size 3"):
            context.increment_batch_size_offset(1)
        context.reset_batch_size_offset()
        context.increment_sequence_len_offset(end - start)
        outputs.append(torch.cat(step_rows, dim=1))
    torch.testing.assert_close(torch.cat(outputs), expected, atol=1e-6, rtol=1e-6)


def test_from_config_sizes_the_cache_as_the_wrapper_config():
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig

    config = InferenceWrapperConfig(hidden_size=8, inference_batch_times_seqlen_threshold=-1, padded_vocab_size=16,
                                    params_dtype=torch.float32, inference_max_requests=5, inference_max_seq_length=7)
    context = StaticInferenceContext.from_config(config)
    assert (context.max_batch_size, context.max_sequence_length) == (5, 7)

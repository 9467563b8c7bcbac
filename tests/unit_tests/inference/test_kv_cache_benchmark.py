"""examples/inference/gpt/benchmark_kv_cache.py: its batched greedy generation without the cache chooses the tokens
of the cached one for prompts of different lengths, and its timings count the forwards of each mode."""

import pytest

from examples.inference.gpt.benchmark_kv_cache import benchmark, generate_greedy_without_cache
from megatron.core import parallel_state
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.static_generation import generate_static_batch
from tests.unit_tests.models.gpt.gpt_test_utils import VOCAB_SIZE, seeded_model, tiny_config
from tests.unit_tests.multiprocess_harness import run_on_ranks

PROMPTS = [[3, 14, 15, 9, 2], [6, 5], [35, 8, 9]]
NEW_TOKENS = 6


def _with_and_without_cache():
    parallel_state.initialize_model_parallel()
    model = seeded_model(tiny_config(num_query_groups=2), position_embedding_type="rope").eval()
    cached = generate_static_batch(model, PROMPTS, SamplingParams(top_k=1, num_tokens_to_generate=NEW_TOKENS),
                                   eod_id=VOCAB_SIZE - 1, max_sequence_length=12, max_batch_size=2 * len(PROMPTS))
    uncached = generate_greedy_without_cache(model, PROMPTS, NEW_TOKENS)
    timings = benchmark(model, PROMPTS, NEW_TOKENS, eod_id=VOCAB_SIZE - 1, vocab_size=None, max_sequence_length=12,
                        max_batch_size=2, repeats=1)
    return [result.generated_tokens for result in cached], uncached, timings


@pytest.mark.parametrize("world_size", [1])
def test_batched_generation_without_the_cache_chooses_the_cached_tokens(world_size):
    ((cached, uncached, timings),) = run_on_ranks(world_size, _with_and_without_cache)
    assert uncached == cached
    assert len({tuple(tokens) for tokens in cached}) == 3  # the prompts lead to different continuations
    # Without the cache: one forward per new token. With it, two batches (2 + 1 prompts): the first prefills
    # 2 positions then steps to 5 + 6 = 11, the second prefills 3 then steps to 3 + 6 = 9.
    assert timings["no cache"]["forward_calls"] == NEW_TOKENS
    assert timings["kv cache"]["forward_calls"] == (1 + 11 - 1 - 2) + (1 + 9 - 1 - 3)
    assert timings["kv cache"]["generated_tokens"] == timings["no cache"]["generated_tokens"] == 3 * NEW_TOKENS
    assert 0 < timings["kv cache"]["prefill_seconds"] <= timings["kv cache"]["seconds"]


def _small_tokenizer_vocabulary(vocab_size):
    parallel_state.initialize_model_parallel()
    model = seeded_model(tiny_config(num_query_groups=2, init_method_std=0.1), position_embedding_type="rope",
                         share_embeddings_and_output_weights=False).eval()
    prompts = [[3, 14, 15, 9, 2], [6, 5], [11, 8, 9]]
    everything = generate_greedy_without_cache(model, prompts, NEW_TOKENS)
    uncached = generate_greedy_without_cache(model, prompts, NEW_TOKENS, vocab_size=vocab_size)
    cached = generate_static_batch(model, prompts, SamplingParams(top_k=1, num_tokens_to_generate=NEW_TOKENS),
                                   eod_id=vocab_size - 1, max_sequence_length=12, max_batch_size=3,
                                   vocab_size=vocab_size)
    benchmark(model, prompts, NEW_TOKENS, eod_id=vocab_size - 1, vocab_size=vocab_size, max_sequence_length=12,
              max_batch_size=3, repeats=1)  # raises when the two modes choose different tokens
    return everything, uncached, [result.generated_tokens for result in cached]


@pytest.mark.parametrize("world_size", [1])
def test_generation_without_the_cache_never_chooses_the_padding_rows(world_size):
    # A tokenizer of 20 ids: the model's other 44 rows are padding, as --make-vocab-size-divisible-by adds.
    ((everything, uncached, cached),) = run_on_ranks(world_size, _small_tokenizer_vocabulary, 20)
    assert any(token >= 20 for tokens in everything for token in tokens)  # the padding rows would win
    assert all(token < 20 for tokens in uncached for token in tokens)
    assert [tokens[:len(mine)] for tokens, mine in zip(uncached, cached)] == cached

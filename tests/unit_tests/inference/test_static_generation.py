"""The static-batch generation loop: prompts of different lengths in one batch, end-of-document stops, padding
ids, log-probabilities, bad input naming the flag; and greedy tokens with the cache equal to greedy decoding by
full forwards over the growing sequence without one."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.inference.model_checks import check_inference_supported
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.static_generation import generate_in_batches, generate_static_batch
from tests.unit_tests.models.gpt.gpt_test_utils import VOCAB_SIZE, seeded_model, tiny_config
from tests.unit_tests.multiprocess_harness import run_on_ranks

GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=4)


class CountingModel(torch.nn.Module):
    """Predicts token + 1 (mod vocab) after every token, with logit 2 against 0 elsewhere; records each call's
    cache offset and length."""

    def __init__(self, vocab=10):
        super().__init__()
        self.vocab = vocab
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.calls = []

    def forward(self, tokens, position_ids, inference_context=None, runtime_gather_output=None):
        assert runtime_gather_output is True  # generation samples from the whole vocabulary
        self.calls.append((inference_context.sequence_len_offset, tokens.shape[1]))
        logits = torch.zeros(*tokens.shape, self.vocab)
        return logits.scatter(-1, ((tokens + 1) % self.vocab).unsqueeze(-1), 2.0)


def _generate(model, prompts, params=GREEDY, eod_id=9, **kwargs):
    kwargs.setdefault("max_sequence_length", 16)
    kwargs.setdefault("max_batch_size", 4)
    return generate_static_batch(model, prompts, params, eod_id=eod_id, **kwargs)


def test_prompts_of_different_lengths_continue_their_own_prompt():
    model = CountingModel()
    short, long_prompt = [1], [5, 0, 3]
    results = _generate(model, [short, long_prompt])
    # The long prompt's tokens are kept while the short one already generates (the model's 1 -> 2 ignored).
    assert results[0].generated_tokens == [2, 3, 4, 5]
    assert results[1].generated_tokens == [4, 5, 6, 7]
    assert results[1].prompt_tokens == long_prompt
    assert not any(result.stopped_at_eod for result in results)
    # Prefill of the shortest prompt, then one position a step until the long prompt has its 4 tokens.
    assert model.calls == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1)]


def test_end_of_document_stops_one_sequence_while_the_other_continues():
    results = _generate(CountingModel(), [[7], [1, 2]])  # 7 -> 8 -> 9 (the end-of-document id)
    assert results[0].generated_tokens == [8, 9] and results[0].stopped_at_eod
    assert results[1].generated_tokens == [3, 4, 5, 6] and not results[1].stopped_at_eod


def test_padding_ids_of_the_vocabulary_are_never_produced():
    # Vocabulary of 8 real tokens padded to 10: after 7 the model prefers the padding id 8.
    results = _generate(CountingModel(), [[7]], eod_id=3, vocab_size=8,
                        params=SamplingParams(top_k=1, num_tokens_to_generate=1))
    assert results[0].generated_tokens == [0]  # all real tokens tie at logit 0: the lowest id


def test_log_probs_of_prompt_and_generated_tokens():
    params = SamplingParams(top_k=1, num_tokens_to_generate=2, return_log_probs=True)
    (result,) = _generate(CountingModel(vocab=10), [[4, 6]], params=params)
    assert result.generated_tokens == [7, 8]
    likely = torch.log_softmax(torch.tensor([2.0] + [0.0] * 9), 0)
    # 4 -> 6 is an unlikely step (logit 0), 6 -> 7 and 7 -> 8 are the model's choice (logit 2).
    torch.testing.assert_close(torch.tensor(result.prompt_log_probs), likely[1:2])
    torch.testing.assert_close(torch.tensor(result.generated_log_probs), likely[:1].repeat(2))
    (plain,) = _generate(CountingModel(vocab=10), [[4, 6]])
    assert plain.prompt_log_probs is None and plain.generated_log_probs is None


def test_top_p_decays_after_every_step_and_restarts_with_each_batch(monkeypatch):
    from megatron.core.inference import static_generation

    used = []
    real_sample = static_generation.sample_next_tokens

    def recording_sample(logits, params, generator):
        used.append(params.top_p)
        return real_sample(logits, params, generator)

    monkeypatch.setattr(static_generation, "sample_next_tokens", recording_sample)
    params = SamplingParams(top_p=0.9, top_p_decay=0.5, top_p_bound=0.2, num_tokens_to_generate=4)
    # One step a position, the first after the shortest prompt (as upstream): max(top_p * 0.5, 0.2) each step.
    _generate(CountingModel(), [[1], [5, 0, 3]], params=params)
    assert used == pytest.approx([0.9, 0.45, 0.225, 0.2, 0.2, 0.2], abs=1e-15)
    used.clear()
    generate_in_batches(CountingModel(), [[1], [2]], params, eod_id=9, max_sequence_length=16, max_batch_size=1)
    assert used == pytest.approx([0.9, 0.45, 0.225, 0.2] * 2, abs=1e-15)


@pytest.mark.parametrize("prompts, kwargs, flag", [
    ([[1]] * 5, {}, "5 prompts but --inference-max-requests is 4"),
    ([[1] * 17], {}, "--inference-max-seq-length 16"),
    ([[1] * 13], {}, "plus --num-tokens-to-generate 4 exceeds --inference-max-seq-length 16"),
    ([[1], []], {}, "prompt 1 is empty"),
    ([], {}, "--prompts"),
    ([[1, 12]], {"vocab_size": 10}, r"prompt 0 holds token ids \[12\] outside the tokenizer's vocabulary of 10"),
    ([[1]], {"vocab_size": 8}, "end-of-document id 9 is outside"),
])
def test_bad_batches_name_the_flag(prompts, kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        _generate(CountingModel(), prompts, **kwargs)


def test_sampling_params_changed_after_they_are_made_are_used_and_checked():
    # As upstream's SamplingParams: set a field, or several with add_attributes, then generate.
    params = SamplingParams(num_tokens_to_generate=2)
    params.top_k = 1
    params.add_attributes({"num_tokens_to_generate": 3, "return_log_probs": True})
    (result,) = _generate(CountingModel(), [[1]], params=params)
    assert result.generated_tokens == [2, 3, 4] and len(result.generated_log_probs) == 3
    params.top_p = 0.5  # top_k is still 1
    with pytest.raises(ValueError, match="--top_k 1 and --top_p 0.5: set only one of them"):
        _generate(CountingModel(), [[1]], params=params)
    params.add_attributes({"top_k": 0, "num_tokens_to_generate": 0})
    with pytest.raises(ValueError, match="--num-tokens-to-generate must be an integer >= 1, got 0"):
        generate_in_batches(CountingModel(), [[1]], params, eod_id=9, max_sequence_length=16, max_batch_size=1)


def test_streamed_tokens_are_the_generated_ones_in_order_across_batches():
    prompts = [[1], [5, 0, 3], [7], [2, 2]]  # 7 -> 8 -> 9 ends the third prompt's document early
    streamed = {}

    def on_tokens(rows, tokens):
        assert len(rows) == len(tokens) and len(set(rows)) == len(rows)
        for row, token in zip(rows, tokens):
            streamed.setdefault(row, []).append(token)

    results = generate_in_batches(CountingModel(), prompts, GREEDY, eod_id=9, max_sequence_length=16,
                                  max_batch_size=3, on_tokens=on_tokens)
    assert streamed == {row: result.generated_tokens for row, result in enumerate(results)}
    assert streamed[2] == [8, 9] and streamed[1] == [4, 5, 6, 7]


def test_more_prompts_than_the_batch_run_in_consecutive_batches_in_prompt_order():
    prompts = [[1], [5, 0, 3], [7], [2, 2], [4]]
    params = SamplingParams(top_k=0, temperature=0.9, num_tokens_to_generate=3, return_log_probs=True)
    model = CountingModel()
    results = generate_in_batches(model, prompts, params, eod_id=9, max_sequence_length=16, max_batch_size=2, seed=3)
    alone = [_generate(CountingModel(), prompts[first:first + 2], params=params, max_batch_size=2, seed=3)
             for first in (0, 2, 4)]
    assert results == alone[0] + alone[1] + alone[2]  # sampled tokens and log-probabilities included
    assert [result.prompt_tokens for result in results] == prompts
    # Three batches, each from cache offset 0: prefill of its shortest prompt, then one position a step.
    assert [call for call in model.calls if call[0] == 0] == [(0, 1), (0, 1), (0, 1)]


def test_batches_are_refused_only_for_a_prompt_that_does_not_fit():
    with pytest.raises(ValueError, match="prompt 4 .* exceeds --inference-max-seq-length 16"):
        generate_in_batches(CountingModel(), [[1]] * 4 + [[1] * 13], GREEDY, eod_id=9, max_sequence_length=16,
                            max_batch_size=2)
    with pytest.raises(ValueError, match="--inference-max-requests must be at least 1"):
        generate_in_batches(CountingModel(), [[1]], GREEDY, eod_id=9, max_sequence_length=16, max_batch_size=0)


@pytest.mark.parametrize("overrides, flag", [
    (dict(context_parallel_size=2), "--context-parallel-size 1"),
    (dict(tp=2, sequence_parallel=True), "--sequence-parallel"),
])
def test_unsupported_parallelism_names_the_flag(overrides, flag):
    with pytest.raises(ValueError, match=flag):
        check_inference_supported(tiny_config(**overrides))


@pytest.mark.parametrize("overrides", [
    # An interleaved pipeline decodes through megatron.inference.virtual_pipeline.VirtualPipelineModel.
    dict(pp=2, num_layers=4, virtual_pipeline_model_parallel_size=2),
    dict(multi_latent_attention=True, kv_lora_rank=12, qk_head_dim=6, qk_pos_emb_head_dim=16, v_head_dim=10),
    dict(tp=2, pp=2, num_query_groups=2),
])
def test_supported_models_pass_the_check(overrides):
    check_inference_supported(tiny_config(**overrides))


def test_pipeline_stages_decode_through_decode_forward_only():
    check_inference_supported(tiny_config(pp=2))  # pipeline parallelism is supported
    with pytest.raises(ValueError, match="pipeline_decoding.decode_forward"):
        check_inference_supported(tiny_config(pp=2), pre_process=True, post_process=False)


def _greedy_with_and_without_cache():
    parallel_state.initialize_model_parallel()
    model = seeded_model(tiny_config(num_query_groups=2), position_embedding_type="rope").eval()
    prompts = [[3, 14, 15, 9, 2], [6, 5], [35, 8, 9]]
    params = SamplingParams(top_k=1, num_tokens_to_generate=6)
    cached = _generate(model, prompts, params=params, eod_id=VOCAB_SIZE - 1, max_sequence_length=12)
    uncached = []
    with torch.no_grad():
        for prompt in prompts:  # one prompt at a time, the whole sequence through the model each step
            sequence = torch.tensor([prompt])
            for _ in range(params.num_tokens_to_generate):
                logits = model(sequence, torch.arange(sequence.shape[1]).unsqueeze(0))
                sequence = torch.cat([sequence, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            uncached.append(sequence[0, len(prompt):].tolist())
    return [result.generated_tokens for result in cached], uncached


@pytest.mark.parametrize("world_size", [1])
def test_greedy_tokens_with_the_cache_equal_full_forwards_without(world_size):
    ((cached, uncached),) = run_on_ranks(world_size, _greedy_with_and_without_cache)
    assert cached == uncached
    assert all(len(tokens) == 6 for tokens in cached)
    assert len({tuple(tokens) for tokens in cached}) == 3  # the prompts lead to different continuations


class PaddedRankingModel(torch.nn.Module):
    """Distinct logits per position (depending on its token) over a vocabulary of 8 real ids padded to 10; the
    padding ids 8 and 9 get the largest logits, so any use of the padded rows shows in the results."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, tokens, position_ids, inference_context=None, runtime_gather_output=None):
        ids = torch.arange(10)
        real = ((ids * (tokens.unsqueeze(-1) + 3)) % 7).float() * 0.5 + ids * 0.01
        return torch.where(ids >= 8, torch.full_like(real, 9.0), real)


def test_top_n_logprobs_are_the_real_vocabulary_log_softmax_at_every_position():
    model = PaddedRankingModel()
    params = SamplingParams(top_k=0, num_tokens_to_generate=3, return_log_probs=True, top_n_logprobs=3)
    prompts = [[1, 4, 2], [6]]
    results = _generate(model, prompts, params=params, eod_id=7, vocab_size=8, seed=5)
    for result in results:
        sequence = torch.tensor(result.prompt_tokens + result.generated_tokens)
        expected = torch.log_softmax(model(sequence[None, :-1], None)[0, :, :8], dim=-1)  # position t -> t + 1
        top = result.prompt_top_n_logprobs + result.generated_top_n_logprobs
        assert len(result.prompt_top_n_logprobs) == len(result.prompt_tokens) - 1
        assert len(top) == len(sequence) - 1
        for position, entries in enumerate(top):
            values, ids = torch.topk(expected[position], 3)
            assert list(entries) == ids.tolist()  # most likely first, never a padding id
            torch.testing.assert_close(torch.tensor(list(entries.values())), values)
        # The log-probabilities are those of a distribution over the 8 real ids: they sum to 1 there.
        log_probs = torch.tensor(result.prompt_log_probs + result.generated_log_probs)
        torch.testing.assert_close(log_probs, expected.gather(-1, sequence[1:, None]).squeeze(-1))
        torch.testing.assert_close(expected.exp().sum(-1), torch.ones(len(sequence) - 1))
    (plain,) = _generate(model, [[1]], params=GREEDY, eod_id=7, vocab_size=8)
    assert plain.generated_top_n_logprobs is None and plain.prompt_top_n_logprobs is None


def test_top_n_logprobs_past_the_vocabulary_or_negative_name_the_flag():
    with pytest.raises(ValueError, match="--top-n-logprobs 9 exceeds the vocabulary size 8"):
        params = SamplingParams(top_k=1, num_tokens_to_generate=2, top_n_logprobs=9)
        _generate(PaddedRankingModel(), [[1]], params=params, eod_id=7, vocab_size=8)
    with pytest.raises(ValueError, match="--top-n-logprobs must be an integer >= 0"):
        SamplingParams(top_n_logprobs=-1)
    with pytest.raises(ValueError, match="return_prompt_top_n_logprobs needs top_n_logprobs > 0"):
        SamplingParams(return_prompt_top_n_logprobs=True)


def test_termination_id_stops_a_sequence_in_place_of_the_end_of_document_id():
    params = SamplingParams(top_k=1, num_tokens_to_generate=4, termination_id=3)
    results = generate_in_batches(CountingModel(), [[1], [4, 5], [7]], params, eod_id=9, max_sequence_length=16,
                                  max_batch_size=2)
    assert results[0].generated_tokens == [2, 3] and results[0].stopped_at_eod  # 1 -> 2 -> 3 ends it
    assert results[1].generated_tokens == [6, 7, 8, 9] and not results[1].stopped_at_eod  # 9 is no stop now
    assert results[2].generated_tokens == [8, 9, 0, 1] and not results[2].stopped_at_eod
    with pytest.raises(ValueError, match="termination_id 12 is outside the tokenizer's vocabulary of 10"):
        _generate(CountingModel(), [[1]], params=SamplingParams(top_k=1, num_tokens_to_generate=2,
                                                                termination_id=12), vocab_size=10)
    with pytest.raises(ValueError, match="termination_id must be a token id >= 0 or None"):
        SamplingParams(termination_id=-1)

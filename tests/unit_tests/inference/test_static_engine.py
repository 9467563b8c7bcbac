"""Upstream's inference API over the static generation loop: GPTInferenceWrapper + InferenceWrapperConfig,
TextGenerationController (and SimpleTextGenerationController), StaticInferenceEngine.generate(prompts,
sampling_params) returning InferenceRequests. Greedy text against a hand-written greedy loop over full forwards,
log-probabilities against the log-softmax of a full forward, batches against one prompt at a time, seeded
sampling, and the errors of bad calls."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.inference.engines import StaticInferenceEngine
from megatron.core.inference.inference_request import InferenceRequest, Status
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.text_generation_controllers.simple_text_generation_controller import (
    SimpleTextGenerationController,
)
from megatron.core.inference.text_generation_controllers.text_generation_controller import TextGenerationController
from megatron.training.tokenizer.null_tokenizer import NullTokenizer
from tests.unit_tests.models.gpt.gpt_test_utils import MAX_SEQUENCE_LENGTH, VOCAB_SIZE, seeded_model, tiny_config
from tests.unit_tests.multiprocess_harness import run_on_ranks

TOKENIZER = NullTokenizer(VOCAB_SIZE - 1)  # ids 0..62 and the end-of-document id 63: the model's 64 rows
PROMPTS = ["3 14 15 9 2", "6 5", "35 8 9"]
PADDED_REAL_VOCAB = 60  # a tokenizer of ids 0..59 (59 the end of document) on the model's 64 rows
PADDED_TOKENIZER = NullTokenizer(PADDED_REAL_VOCAB - 1)


def _engine(model, max_requests=8, controller_class=TextGenerationController, tokenizer=TOKENIZER, **engine_kwargs):
    config = InferenceWrapperConfig(hidden_size=32, inference_batch_times_seqlen_threshold=-1,
                                    padded_vocab_size=VOCAB_SIZE, params_dtype=torch.float32,
                                    inference_max_requests=max_requests, inference_max_seq_length=64)
    return StaticInferenceEngine(controller_class(GPTInferenceWrapper(model, config), tokenizer), **engine_kwargs)


def _full_forward_greedy(model, prompt_tokens, num_tokens):
    """(greedy tokens, log-probabilities of every token after the first) by full forwards without a cache."""
    with torch.no_grad():
        sequence = torch.tensor([prompt_tokens])
        for _ in range(num_tokens):
            logits = model(sequence, torch.arange(sequence.shape[1]).unsqueeze(0))
            sequence = torch.cat([sequence, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        logits = model(sequence, torch.arange(sequence.shape[1]).unsqueeze(0))
        log_probs = torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, sequence[0, 1:, None]).squeeze(-1)
    return sequence[0, len(prompt_tokens):].tolist(), log_probs


def _engine_generations():
    parallel_state.initialize_model_parallel()
    model = seeded_model(tiny_config(num_query_groups=2), position_embedding_type="rope").eval()
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=4, return_log_probs=True)
    batched = _engine(model, max_requests=2).generate(prompts=PROMPTS, sampling_params=greedy)
    alone = [_engine(model, controller_class=SimpleTextGenerationController).generate(
        prompts=[prompt], sampling_params=greedy)[0] for prompt in PROMPTS[:2]]
    expected = [_full_forward_greedy(model, request.prompt_tokens, 4) for request in batched]
    sampled = SamplingParams(top_k=0, temperature=1.5, num_tokens_to_generate=4)
    seeded = [_engine(model, random_seed=5).generate(prompts=PROMPTS[:1], sampling_params=sampled)[0]
              for _ in range(2)]
    torch.manual_seed(11)
    first = _engine(model).generate(prompts=PROMPTS[:1], sampling_params=sampled)[0]
    torch.manual_seed(11)
    second = _engine(model).generate(prompts=PROMPTS[:1], sampling_params=sampled)[0]
    with pytest.raises(ValueError) as too_long:
        _engine(model).generate(prompts=["1 2 3 4 5 6 7 8 9 10 11 12 13"], sampling_params=greedy)
    top_n = SamplingParams(top_k=0, num_tokens_to_generate=3, return_log_probs=True, top_n_logprobs=PADDED_REAL_VOCAB,
                           return_prompt_top_n_logprobs=True)
    (padded,) = _engine(model, tokenizer=PADDED_TOKENIZER, random_seed=3).generate(prompts=PROMPTS[:1],
                                                                                  sampling_params=top_n)
    sequence = torch.tensor([padded.prompt_tokens + padded.generated_tokens])
    with torch.no_grad():
        padded_logits = model(sequence, torch.arange(sequence.shape[1]).unsqueeze(0))[0, :-1]
    top_n_outputs = (padded, sequence[0], padded_logits)
    return batched, alone, expected, seeded, (first, second), top_n_outputs, str(too_long.value)


@pytest.fixture(scope="module")
def generations():
    (result,) = run_on_ranks(1, _engine_generations)
    return result


def test_greedy_requests_equal_a_greedy_loop_over_full_forwards(generations):
    batched, _, expected, *_ = generations
    assert [request.request_id for request in batched] == ["0", "1", "2"]
    assert [request.prompt for request in batched] == PROMPTS
    assert batched[1].prompt_tokens == [6, 5]
    for request, (tokens, log_probs) in zip(batched, expected):
        assert request.status == Status.COMPLETED
        assert request.generated_tokens == tokens and request.generated_length == 4
        assert request.generated_text == TOKENIZER.detokenize(tokens) and not request.stopped_at_eod
        got = torch.tensor(request.prompt_log_probs + request.generated_log_probs)
        torch.testing.assert_close(got, log_probs, atol=2e-6, rtol=0)
    assert len({tuple(request.generated_tokens) for request in batched}) == 3


def test_batches_of_two_give_each_prompt_its_tokens_alone(generations):
    batched, alone, *_ = generations
    # The first batch holds prompts 0 and 1 (5 and 2 tokens long); the second prompt 2 alone.
    assert [request.generated_tokens for request in alone] == [request.generated_tokens for request in batched[:2]]


def test_sampling_is_reproducible_from_the_engine_seed_or_torch_manual_seed(generations):
    *_, seeded, (first, second), _, _ = generations
    assert seeded[0].generated_tokens == seeded[1].generated_tokens
    assert first.generated_tokens == second.generated_tokens
    assert len(first.generated_tokens) == 4


def test_top_n_logprobs_are_detokenized_and_cover_only_the_real_vocabulary(generations):
    request, sequence, logits = generations[-2]
    expected = torch.log_softmax(logits[:, :PADDED_REAL_VOCAB].float(), dim=-1)  # position t -> token t + 1
    top = request.prompt_top_n_logprobs + request.generated_top_n_logprobs
    assert len(request.prompt_top_n_logprobs) == 4 and len(request.generated_top_n_logprobs) == 3
    for position, entries in enumerate(top):
        # Every real token, keyed by its text, most likely first; the padding rows 60..63 have no mass.
        values, ids = torch.sort(expected[position], descending=True)
        assert list(entries) == [PADDED_TOKENIZER.detokenize([token]) for token in ids.tolist()]
        torch.testing.assert_close(torch.tensor(list(entries.values())), values)
        torch.testing.assert_close(torch.tensor(list(entries.values())).exp().sum(), torch.tensor(1.0))
    got = torch.tensor(request.prompt_log_probs + request.generated_log_probs)
    torch.testing.assert_close(got, expected.gather(-1, sequence[1:, None]).squeeze(-1))


def test_a_prompt_past_the_model_positions_names_the_flag(generations):
    message = generations[-1]
    assert message == ("prompt 0 (13 tokens) plus --num-tokens-to-generate 4 exceeds --max-position-embeddings "
                       f"{MAX_SEQUENCE_LENGTH}: the model has no positions past it: shorten the prompt or generate "
                       "fewer tokens")


class _NoModel(torch.nn.Module):
    max_sequence_length = 16


def test_bad_calls_name_what_to_pass_instead():
    engine = _engine(_NoModel())
    with pytest.raises(ValueError, match="pass prompts or inference_requests"):
        engine.generate()
    with pytest.raises(ValueError, match="encoder_prompts are for encoder-decoder models"):
        engine.generate(prompts=["1"], encoder_prompts=["2"])
    with pytest.raises(ValueError, match="prompts must be a non-empty list of strings"):
        engine.generate(prompts="1 2")
    with pytest.raises(ValueError, match="NullTokenizer has no beginning-of-sequence token"):
        engine.generate(prompts=["1"], add_BOS=True)
    requests = [InferenceRequest("a", "1", SamplingParams(top_k=1), [1]),
                InferenceRequest("b", "2", SamplingParams(top_k=2), [2])]
    with pytest.raises(ValueError, match="request b has other sampling_params than request a"):
        engine.generate(inference_requests=requests)
    with pytest.raises(ValueError, match="GPTInferenceWrapper takes one model"):
        GPTInferenceWrapper([_NoModel()], engine.text_generation_controller.inference_wrapped_model
                            .inference_wrapper_config)
    with pytest.warns(UserWarning, match="setting `max_batch_size` to 8"):
        assert _engine(_NoModel(), max_batch_size=32).max_batch_size == 8

"""The server's OpenAI text completions (`POST /v1/completions`, megatron/inference/completion_request.py and
text_completion.py): greedy choices are the generation of each prompt's tokens (equal to `generate_in_batches` and
to `PUT /api`), one per prompt in order, `stop` strings end a choice and are cut from its text, `usage` counts the
tokens, every bad field is a 400 naming it, and PP2 serves one rank's choices."""

import json
import re
import threading
import time

import pytest

from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.static_generation import generate_in_batches
from megatron.inference import text_generation_server
from megatron.inference.completion_request import parse_completion_request
from megatron.inference.generation_request import DEFAULT_TOKENS_TO_GENERATE
from megatron.inference.text_generation_server import TextGenerationServer
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.tools.test_chat_completions import (
    LIMITS,
    TOKENIZER,
    ScriptedReplyModel,
    _model,
    _send,
    served_at,
)

MODEL_NAME = "runs/tiny_gpt/checkpoints"
PROMPTS = ["def add(a, b):", "The path", "x"]  # three prompts: two batches of at most LIMITS.max_batch_size 2


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def server(model):
    return TextGenerationServer(model, TOKENIZER, LIMITS, model_name=MODEL_NAME)  # no chat format needed


@pytest.fixture(scope="module")
def base_url(server):
    http_server = server.make_http_server("127.0.0.1", 0)
    threading.Thread(target=http_server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{http_server.server_address[1]}"
    http_server.shutdown()
    http_server.server_close()


def test_greedy_choices_are_the_generations_of_the_prompts_in_order(model, base_url, monkeypatch):
    broadcast = []
    original_broadcast = text_generation_server.broadcast_from_rank0
    monkeypatch.setattr(text_generation_server, "broadcast_from_rank0",
                        lambda job=None: broadcast.append(job) or original_broadcast(job))
    before = int(time.time())
    status, answer = _send(base_url + "/v1/completions",
                           {"model": "any", "prompt": PROMPTS, "max_tokens": 10, "temperature": 0, "echo": False,
                            "logprobs": None, "n": 1, "stream": False})
    assert status == 200, answer
    prompt_tokens = [TOKENIZER.tokenize(prompt) for prompt in PROMPTS]
    assert [job.prompt_tokens for job in broadcast] == [prompt_tokens]  # the job the other ranks follow
    expected = generate_in_batches(model, prompt_tokens, SamplingParams(top_k=1, num_tokens_to_generate=10),
                                   eod_id=LIMITS.eod_id, max_sequence_length=LIMITS.max_sequence_length,
                                   max_batch_size=LIMITS.max_batch_size, vocab_size=LIMITS.vocab_size, seed=1)
    assert not any(result.stopped_at_eod for result in expected)
    texts = [TOKENIZER.detokenize(result.generated_tokens) for result in expected]
    assert len(set(texts)) == 3
    assert answer["choices"] == [{"index": index, "text": text, "finish_reason": "length", "logprobs": None}
                                 for index, text in enumerate(texts)]
    prompt_count = sum(len(tokens) for tokens in prompt_tokens)
    assert answer["usage"] == {"prompt_tokens": prompt_count, "completion_tokens": 30,
                               "total_tokens": prompt_count + 30}
    assert answer["object"] == "text_completion" and answer["model"] == MODEL_NAME
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", answer["id"]) and before <= answer["created"] <= time.time()
    # PUT /api continues the prompts the same way.
    status, api_answer = _send(base_url + "/api", {"prompts": PROMPTS, "tokens_to_generate": 10, "top_k": 1,
                                                   "no_log": True}, method="PUT")
    assert status == 200 and api_answer["text"] == [prompt + text for prompt, text in zip(PROMPTS, texts)]
    # A string prompt is a list of one.
    status, single = _send(base_url + "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 10, "temperature": 0})
    assert status == 200 and single["choices"] == [dict(answer["choices"][1], index=0)]


def test_sampling_fields_and_seed_and_the_default_max_tokens(model, server):
    assert parse_completion_request({"prompt": "Hi"}).max_tokens == DEFAULT_TOKENS_TO_GENERATE == 64
    body = {"prompt": ["Hi", "Yo"], "max_tokens": 6, "temperature": 0.8, "top_p": 0.9, "seed": 5}
    status, answer = server.handle_completion(body)
    assert status == 200, answer
    expected = generate_in_batches(model, [TOKENIZER.tokenize("Hi"), TOKENIZER.tokenize("Yo")],
                                   SamplingParams(temperature=0.8, top_p=0.9, num_tokens_to_generate=6),
                                   eod_id=LIMITS.eod_id, max_sequence_length=LIMITS.max_sequence_length,
                                   max_batch_size=LIMITS.max_batch_size, vocab_size=LIMITS.vocab_size, seed=5)
    assert [choice["text"] for choice in answer["choices"]] == [
        TOKENIZER.detokenize([token for token in result.generated_tokens if token != LIMITS.eod_id])
        for result in expected]
    assert server.handle_completion(body)[1]["choices"] == answer["choices"]  # the same seed, the same choices


@pytest.mark.parametrize("stop, max_tokens, text, finish_reason, completion_tokens", [
    # A stop string ends the choice (the end-of-document token it forces is not counted) and is cut.
    ("\n\n", 40, "Hello", "stop", len("Hello\n\n")),
    (["world", "lo"], 40, "Hel", "stop", len("Hello")),  # the first stop string in the text cuts it
    # No stop string in the text: the model's own end-of-document token ends it (and is counted), or max_tokens.
    ("STOP", 40, "Hello\n\nworld", "stop", len("Hello\n\nworld") + 1),
    ("STOP", 4, "Hell", "length", 4),
    (None, 7, "Hello\n\n", "length", 7),
    # max_tokens ends it as the stop string completes: still a stop.
    ("\n\n", len("Hello\n\n"), "Hello", "stop", len("Hello\n\n")),
])
def test_stop_strings_end_the_choice_and_are_cut(stop, max_tokens, text, finish_reason, completion_tokens):
    prompt = "abcd"
    model = ScriptedReplyModel(len(prompt), TOKENIZER.tokenize("Hello\n\nworld")).eval()
    server = TextGenerationServer(model, TOKENIZER, LIMITS)
    body = {"prompt": [prompt, "wxyz"], "max_tokens": max_tokens, "temperature": 0}
    if stop is not None:
        body["stop"] = stop
    status, answer = server.handle_completion(body)
    assert status == 200, answer
    choice = {"text": text, "finish_reason": finish_reason, "logprobs": None}
    assert answer["choices"] == [dict(choice, index=0), dict(choice, index=1)]
    assert answer["usage"] == {"prompt_tokens": 8, "completion_tokens": 2 * completion_tokens,
                               "total_tokens": 8 + 2 * completion_tokens}


@pytest.mark.parametrize("body, message", [
    ("Hi", r"^the request body must be a JSON object, such as \{\"prompt\""),
    ({}, r"^prompt is required"),
    ({"prompt": [1, 2]}, r"^prompt must be a string or a list of strings \(token ids are not accepted\)$"),
    ({"prompt": []}, r"^prompt must hold 1 to 128 strings, got 0$"),
    ({"prompt": [""] * 129}, r"^prompt must hold 1 to 128 strings, got 129$"),
    ({"prompt": ""}, r"^prompt has no tokens"),
    ({"prompt": ["Hi", ""]}, r"^prompt\[1\] has no tokens"),
    ({"prompt": ["Hi", "x" * 250]}, r"^prompt\[1\] \(250 tokens\) plus max_tokens 64 is longer than allowed: at "
                                    r"most 256 tokens"),
    ({"prompt": "Hi", "stop": ""}, r"^stop must be a non-empty string or a list of 1 to 4 non-empty strings$"),
    ({"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, r"^stop must be a non-empty string or a list of 1 to 4"),
    ({"prompt": "Hi", "stop": []}, r"^stop must be"),
    ({"prompt": "Hi", "stop": 3}, r"^stop must be"),
    ({"prompt": "Hi", "echo": True}, r"^echo: answers hold the generated text only"),
    ({"prompt": "Hi", "logprobs": 2}, r"^logprobs: log-probabilities are not returned by this endpoint"),
    ({"prompt": "Hi", "logprobs": 0}, r"^logprobs: "),
    ({"prompt": "Hi", "n": 2}, r"^n: this server answers with one choice"),
    ({"prompt": "Hi", "stream": True}, r"^stream: streamed answers are not implemented"),
    ({"prompt": "Hi", "model": 3}, r"^model must be a string"),
    ({"prompt": "Hi", "max_tokens": 0}, r"^max_tokens must be an integer greater than or equal to 1$"),
    ({"prompt": "Hi", "temperature": -1}, r"^temperature must be a number from 0 \(greedy\) to 100"),
    ({"prompt": "Hi", "top_p": 0}, r"^top_p must be a number greater than 0 and at most 1.0"),
    ({"prompt": "Hi", "top_k": 300}, r"^top_k 300 exceeds the tokenizer's vocabulary of 257 tokens$"),
    ({"prompt": "Hi", "top_k": 5, "top_p": 0.5}, r"^cannot set both top_k and top_p"),
    ({"prompt": "Hi", "seed": 2 ** 64}, r"^seed must be a non-negative integer at most 18446744073709551615"),
    ({"prompt": "Hi", "suffix": "!"}, r"^unknown field\(s\) suffix: the accepted fields are prompt, stop, echo, "
                                      r"logprobs, model, max_tokens"),
])
def test_each_bad_field_is_a_400_naming_it(server, body, message):
    status, answer = server.handle_completion(body)
    assert status == 400 and set(answer) == {"message"}
    assert re.search(message, answer["message"]), answer["message"]


def test_http_routes(base_url):
    url = base_url + "/v1/completions"
    status, answer = _send(url, b"[not json")
    assert status == 400 and answer["message"].startswith("the request body is not JSON")
    status, answer = _send(url, {"prompt": "Hi", "echo": True})
    assert status == 400 and answer["message"].startswith("echo:")
    status, answer = _send(url, b"{}", method="GET")
    assert status == 405 and answer["message"] == ('use POST /v1/completions with a JSON body, such as '
                                                   '{"prompt": "def hello():", "max_tokens": 32, "stop": ["\\n\\n"]}')
    assert json.loads(answer["message"].split("such as ", 1)[1])["stop"] == ["\n\n"]


def _completions_served_at(pp):
    return served_at(pp, lambda server: [
        server.handle_completion({"prompt": PROMPTS, "max_tokens": 6, **fields})[1]["choices"]
        for fields in ({"temperature": 0, "stop": "e"}, {"temperature": 1.5, "seed": 9})])


def _one_rank_then_pp2():
    return _completions_served_at(1), _completions_served_at(2)


@pytest.mark.parametrize("world_size", [2])
def test_pp2_serves_the_choices_of_one_rank(world_size):
    (one_rank, pp2), _ = run_on_ranks(world_size, _one_rank_then_pp2)
    assert pp2 == one_rank and one_rank[0] != one_rank[1]

"""The text-generation server (`megatron.inference`): upstream's request validation (each bad field a 400 naming
it), a greedy request served over HTTP equal to `generate_in_batches`, top_p_decay / top_p_bound shrinking the
nucleus per step, log-probabilities equal to the
log-softmax of a full forward, upstream's newline options, and TP2 serving the text (and scores) TP1 serves."""

import json
import re
import socket
import threading
import urllib.error
import urllib.request

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.static_generation import generate_in_batches
from megatron.inference.generation_request import parse_generation_request
from megatron.inference.text_generation import GenerationLimits
from megatron.inference.text_generation_server import TextGenerationServer, follow_requests
from megatron.training.tokenizer.null_tokenizer import NullTokenizer
from tests.unit_tests.models.gpt.gpt_test_utils import seeded_model, tiny_config
from tests.unit_tests.multiprocess_harness import run_on_ranks

# Text ids 0..59 and end-of-document 60: 61 real tokens in the model's 64 rows.
TOKENIZER = NullTokenizer(60)
LIMITS = GenerationLimits(eod_id=TOKENIZER.eod, vocab_size=TOKENIZER.vocab_size, max_sequence_length=16,
                          max_batch_size=2)
PROMPTS = ["3 14 15 9 2", "6 5", "35 8 9"]


def _model(tp=1, pp=1):
    stage = {}
    if pp > 1:
        stage = dict(pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    return seeded_model(tiny_config(tp=tp, pp=pp, num_query_groups=2), position_embedding_type="rope", **stage)


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def server(model):
    return TextGenerationServer(model, TOKENIZER, LIMITS)


@pytest.fixture(scope="module")
def http_url(server):
    http_server = server.make_http_server("127.0.0.1", 0)
    thread = threading.Thread(target=http_server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{http_server.server_address[1]}/api"
    http_server.shutdown()
    http_server.server_close()


def _put(url, data: bytes, method="PUT"):
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize("body, message", [
    ({}, "prompts argument required"),
    ({"prompts": "3 4"}, "prompts is not a list of strings"),
    ({"prompts": [3, 4]}, "prompts is not a list of strings"),
    ({"prompts": []}, "prompts is empty"),
    ({"prompts": ["1"] * 129}, "Maximum number of prompts is 128"),
    ({"prompts": ["1"], "tokens_to_generate": -1}, "tokens_to_generate must be an integer"),
    ({"prompts": ["1"], "tokens_to_generate": 2.5}, "tokens_to_generate must be an integer"),
    ({"prompts": ["1"], "tokens_to_generate": 0}, "tokens_to_generate=0 implies logprobs should be True"),
    ({"prompts": ["1"], "logprobs": "yes"}, "logprobs must be a boolean value"),
    ({"prompts": ["1"], "temperature": 0}, "temperature must be a positive number"),
    ({"prompts": ["1"], "temperature": 101.0}, "temperature must be a positive number"),
    ({"prompts": ["1"], "top_k": -1}, "top_k must be an integer"),
    ({"prompts": ["1"], "top_k": 1001}, "top_k must be an integer"),
    ({"prompts": ["1"], "top_k": 62}, "top_k 62 exceeds the tokenizer's vocabulary of 61"),
    ({"prompts": ["1"], "top_p": 1.5}, "top_p must be a number from 0.0 to 1.0"),
    ({"prompts": ["1"], "top_k": 5, "top_p": 0.5}, "cannot set both top-k and top-p"),
    ({"prompts": ["1"], "add_BOS": 1}, "add_BOS must be a boolean value"),
    ({"prompts": [""]}, "Empty prompts require add_BOS=true"),
    ({"prompts": ["1"], "random_seed": -1}, "random_seed must be a non-negative integer"),
    ({"prompts": ["1"], "random_seed": 2 ** 64},
     "random_seed must be a non-negative integer at most 18446744073709551615"),
    ({"prompts": ["1"], "no_log": "no"}, "no_log must be a boolean value"),
    ({"prompts": ["1"], "stop_on_eol": 1}, "stop_on_eol must be a boolean value"),
    ({"prompts": ["1"], "stop_on_double_eol": None}, "stop_on_double_eol must be a boolean value"),
    ({"prompts": ["1"], "prevent_newline_after_colon": "x"}, "prevent_newline_after_colon must be a boolean"),
    ({"prompts": ["1"], "stop_on_eol": True}, "stop_on_eol needs a tokenizer that encodes '\\\\n' as one token"),
    ({"prompts": ["1"], "beam_width": 2}, "beam_width: beam search is not implemented"),
    ({"prompts": ["1"], "stop_token": 5}, "stop_token: "),
    ({"prompts": ["1"], "length_penalty": 1.0}, "length_penalty: "),
    ({"prompts": ["1"], "top_p_decay": 0.5}, "^top_p_decay cannot be set without top_p$"),
    ({"prompts": ["1"], "top_p": 0.5, "top_p_decay": "0.5"},
     "^top_p_decay must be a positive float less than or equal to 1.0$"),
    ({"prompts": ["1"], "top_p": 0.5, "top_p_decay": -0.5},
     "^top_p_decay must be a positive float less than or equal to 1.0$"),
    ({"prompts": ["1"], "top_p": 0.5, "top_p_decay": 1.5}, "^top_p_decay must be less than or equal to 1.0$"),
    ({"prompts": ["1"], "top_p_bound": 0.1}, "^top_p_bound cannot be set without top_p$"),
    ({"prompts": ["1"], "top_p": 0.5, "top_p_bound": True},
     "^top_p_bound must be a positive float less than or equal to top_p$"),
    ({"prompts": ["1"], "top_p": 0.5, "top_p_bound": 0.6}, "^top_p_bound must be greater than 0 and less than top_p$"),
    ({"prompts": ["1"], "top_p": 0.5, "top_p_bound": 0.0}, "^top_p_bound must be greater than 0 and less than top_p$"),
    ({"sentences": ["1"]}, "sentences is no longer used.  Replace with prompts"),
    ({"prompts": ["1"], "max_len": 4}, "max_len is no longer used.  Replace with tokens_to_generate"),
    ({"prompts": ["1"], "top-k": 4}, "unknown field\\(s\\) top-k"),
    ({"prompts": ["1 2 3"], "tokens_to_generate": 14}, r"prompts\[0\] \(3 tokens\) plus tokens_to_generate 14"),
    ({"prompts": ["1", "61"], "tokens_to_generate": 2}, r"prompts\[1\] cannot be tokenized"),
    (["1"], "the request body must be a JSON object"),
    ({"prompts": ["1"], "top_n_logprobs": -1}, "top_n_logprobs must be an integer greater than or equal to 0"),
    ({"prompts": ["1"], "top_n_logprobs": 2.0}, "top_n_logprobs must be an integer greater than or equal to 0"),
    ({"prompts": ["1"], "top_n_logprobs": 62}, "top_n_logprobs 62 exceeds the tokenizer's vocabulary of 61"),
])
def test_each_bad_field_is_a_400_naming_it(server, body, message):
    status, payload = server.handle(body)
    assert status == 400
    assert set(payload) == {"message"}
    assert re.search(message, payload["message"]), payload["message"]


def test_upstream_defaults():
    request = parse_generation_request({"prompts": ["a"]})
    assert (request.tokens_to_generate, request.temperature, request.top_k, request.top_p) == (64, 1.0, 0, 0.0)
    assert not (request.logprobs or request.add_BOS or request.stop_on_eol or request.stop_on_double_eol
                or request.prevent_newline_after_colon or request.no_log)
    assert request.random_seed is None


def test_served_greedy_request_equals_generate_in_batches(model, http_url):
    body = {"prompts": PROMPTS, "tokens_to_generate": 5, "top_k": 1, "no_log": True}
    status, payload = _put(http_url, json.dumps(body).encode())
    assert status == 200
    assert set(payload) == {"text", "segments", "logprobs", "tokens"} and payload["logprobs"] is None
    prompt_tokens = [TOKENIZER.tokenize(prompt) for prompt in PROMPTS]
    expected = generate_in_batches(model, prompt_tokens, SamplingParams(top_k=1, num_tokens_to_generate=5),
                                   eod_id=TOKENIZER.eod, max_sequence_length=16, max_batch_size=2,
                                   vocab_size=TOKENIZER.vocab_size)
    expected_tokens = [result.prompt_tokens + result.generated_tokens for result in expected]
    assert payload["tokens"] == expected_tokens
    assert payload["text"] == [TOKENIZER.detokenize(tokens) for tokens in expected_tokens]
    assert payload["segments"] == [[str(token) for token in tokens] for tokens in expected_tokens]
    assert all(len(result.generated_tokens) == 5 for result in expected)  # no end-of-document in 5 steps
    assert payload["text"][1].startswith("6 5 ")


def test_served_top_p_decay_and_bound_shrink_the_nucleus_per_step(model, http_url):
    body = {"prompts": PROMPTS[:2], "tokens_to_generate": 6, "temperature": 5.0, "top_p": 1.0, "top_p_decay": 0.1,
            "top_p_bound": 0.01, "random_seed": 3, "no_log": True}
    request = parse_generation_request(body)
    assert (request.top_p, request.top_p_decay, request.top_p_bound) == (1.0, 0.1, 0.01)
    status, payload = _put(http_url, json.dumps(body).encode())
    assert status == 200, payload
    prompt_tokens = [TOKENIZER.tokenize(prompt) for prompt in PROMPTS[:2]]

    def generated(**schedule):
        params = SamplingParams(temperature=5.0, top_p=1.0, num_tokens_to_generate=6, **schedule)
        results = generate_in_batches(model, prompt_tokens, params, eod_id=TOKENIZER.eod, max_sequence_length=16,
                                      max_batch_size=2, vocab_size=TOKENIZER.vocab_size, seed=3)
        return [result.prompt_tokens + result.generated_tokens for result in results]

    assert payload["tokens"] == generated(top_p_decay=0.1, top_p_bound=0.01)
    assert payload["tokens"] != generated()  # not the text of a fixed top_p 1.0 at temperature 5
    # Steps 0, 1, 2, ... (positions from the shortest prompt's end) use top_p 1.0, 0.1, then the bound 0.01: the
    # most likely of 61 tokens has a probability of at least 1/61 > 0.01, so that nucleus holds it alone, and the
    # last three tokens of each sequence (steps 3 to 5) are the argmax of a full forward.
    for tokens in payload["tokens"]:
        with torch.no_grad():
            logits = model.eval()(torch.tensor([tokens]), torch.arange(len(tokens)).unsqueeze(0))
        argmax = logits[0, :-1, :TOKENIZER.vocab_size].argmax(-1).tolist()
        assert tokens[-3:] == argmax[-3:]


def test_http_errors_are_json_with_a_message(http_url):
    status, payload = _put(http_url, b"{not json")
    assert status == 400 and payload["message"].startswith("the request body is not JSON")
    status, payload = _put(http_url, json.dumps({"prompts": ["1"], "top_k": -3}).encode())
    assert status == 400 and "top_k" in payload["message"]
    assert _put(http_url, b"{}", method="POST")[0] == 405
    assert _put(http_url.replace("/api", "/other"), b"{}")[0] == 404


def test_the_largest_random_seed_is_served(server):
    body = {"prompts": PROMPTS[:1], "tokens_to_generate": 3, "random_seed": 2 ** 64 - 1, "no_log": True}
    status, payload = server.handle(body)
    assert status == 200, payload
    assert len(payload["tokens"][0]) == len(TOKENIZER.tokenize(PROMPTS[0])) + 3


def _raw_put(url, head: bytes, body: bytes, timeout=60):
    """Status and JSON answer of a PUT whose headers (after the request line) and body are sent as given."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as connection:
        connection.sendall(b"PUT /api HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n" + body)
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < _content_length(reply):
            piece = connection.recv(65536)
            if not piece:
                break
            reply += piece
    status_line, _, rest = reply.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.split(b"\r\n\r\n", 1)[1])


def _content_length(reply):
    match = re.search(rb"Content-Length: (\d+)", reply)
    return int(match.group(1)) if match else 0


def test_request_body_framing(http_url):
    body = json.dumps({"prompts": ["6 5"], "tokens_to_generate": 2, "top_k": 1, "no_log": True}).encode()
    status, plain = _raw_put(http_url, b"Content-Length: %d\r\n" % len(body), body)
    assert status == 200 and plain["tokens"][0][:2] == [6, 5]
    # The same body sent in chunks (as clients streaming a body do) gets the same answer.
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:7], body[7:])) + b"0\r\n\r\n"
    assert _raw_put(http_url, b"Transfer-Encoding: chunked\r\n", chunked) == (200, plain)
    status, payload = _raw_put(http_url, b"Content-Length: ten\r\n", body)
    assert status == 400 and payload["message"] == "Content-Length must be a non-negative integer, got 'ten'"
    # A negative chunk size is refused at once (reading "-5 bytes" would wait for the client to close).
    status, payload = _raw_put(http_url, b"Transfer-Encoding: chunked\r\n", b"-5\r\n{}", timeout=10)
    assert status == 400 and payload["message"].startswith("bad chunk size b'-5' in the chunked request body")


def test_a_body_past_the_size_limit_is_a_413_and_the_server_keeps_serving(http_url):
    from megatron.inference.text_generation_server import MAX_REQUEST_BYTES

    declared = 10 ** 11  # far more memory than the host has: reading it whole would raise MemoryError
    status, payload = _raw_put(http_url, b"Content-Length: %d\r\n" % declared, b"{}")
    assert status == 413
    assert payload["message"] == (f"the request body ({declared} bytes) is larger than the {MAX_REQUEST_BYTES} "
                                  "bytes this server reads: send fewer or shorter prompts")
    chunked = b"%x\r\n{}" % (MAX_REQUEST_BYTES + 1)
    status, payload = _raw_put(http_url, b"Transfer-Encoding: chunked\r\n", chunked)
    assert status == 413 and f"({MAX_REQUEST_BYTES + 1} bytes)" in payload["message"]
    body = json.dumps({"prompts": ["6 5"], "tokens_to_generate": 2, "top_k": 1, "no_log": True}).encode()
    status, payload = _raw_put(http_url, b"Content-Length: %d\r\n" % len(body), body)
    assert status == 200 and payload["tokens"][0][:2] == [6, 5]


def test_a_follower_keeps_following_after_a_failed_job(monkeypatch):
    from megatron.inference import text_generation_server

    broadcasts = iter(["bad job", "good job", "stop"])
    ran = []

    def run_job(model, job, limits):
        ran.append(job)
        if job == "bad job":
            raise ValueError("this job fails on every rank")

    monkeypatch.setattr(text_generation_server, "broadcast_from_rank0", lambda job=None: next(broadcasts))
    monkeypatch.setattr(text_generation_server, "run_job", run_job)
    follow_requests(None, LIMITS)
    assert ran == ["bad job", "good job"]


def _full_forward_log_probs(model, tokens):
    with torch.no_grad():
        ids = torch.tensor([tokens])
        logits = model.eval()(ids, torch.arange(len(tokens)).unsqueeze(0))
    log_probs = torch.log_softmax(logits[0, :-1, :TOKENIZER.vocab_size].float(), dim=-1)
    return log_probs.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("tokens_to_generate", [0, 4])
def test_logprobs_are_the_log_softmax_of_the_model_logits(model, server, tokens_to_generate):
    body = {"prompts": PROMPTS, "tokens_to_generate": tokens_to_generate, "logprobs": True, "top_k": 0,
            "temperature": 0.7, "random_seed": 5, "no_log": True}
    status, payload = server.handle(body)
    assert status == 200
    for tokens, log_probs, prompt in zip(payload["tokens"], payload["logprobs"], PROMPTS):
        assert len(tokens) == len(TOKENIZER.tokenize(prompt)) + tokens_to_generate
        assert len(log_probs) == len(tokens) - 1
        torch.testing.assert_close(torch.tensor(log_probs), _full_forward_log_probs(model, tokens), atol=1e-5,
                                   rtol=0)
    # The same seed gives the same sampled text.
    assert server.handle(body)[1]["tokens"] == payload["tokens"]


@pytest.mark.parametrize("tokens_to_generate", [0, 3])
def test_top_n_logprobs_list_the_likeliest_real_tokens_of_every_scored_position(model, server, tokens_to_generate):
    body = {"prompts": PROMPTS[:2], "tokens_to_generate": tokens_to_generate, "logprobs": True, "top_n_logprobs": 4,
            "random_seed": 2, "no_log": True}
    status, payload = server.handle(body)
    assert status == 200
    for tokens, log_probs, top_n in zip(payload["tokens"], payload["logprobs"], payload["top_n_logprobs"]):
        with torch.no_grad():
            logits = model.eval()(torch.tensor([tokens]), torch.arange(len(tokens)).unsqueeze(0))
        # Over the tokenizer's 61 ids only: the model's padding rows 61..63 are never listed.
        expected = torch.log_softmax(logits[0, :-1, :TOKENIZER.vocab_size].float(), dim=-1)
        assert len(top_n) == len(log_probs) == len(tokens) - 1
        for position, entries in enumerate(top_n):
            values, ids = torch.topk(expected[position], 4)
            assert list(entries) == [TOKENIZER.detokenize([token]) for token in ids.tolist()]
            torch.testing.assert_close(torch.tensor(list(entries.values())), values, atol=1e-5, rtol=0)
    assert "top_n_logprobs" not in server.handle({**body, "top_n_logprobs": 0})[1]


class CharTokenizer:
    """One id per character of CHARS, end-of-document after them."""
    CHARS = "ab:\nc"
    eod = len(CHARS)
    vocab_size = len(CHARS) + 1

    def tokenize(self, text):
        return [self.CHARS.index(char) for char in text]

    def detokenize(self, ids):
        return "".join(self.CHARS[token] for token in ids if token < self.eod)


class SuccessorModel(torch.nn.Module):
    """Prefers a -> b -> : -> newline -> newline, and c -> a, : -> c second (logits 2 and 1, else 0)."""
    FIRST = {"a": "b", "b": ":", ":": "\n", "\n": "\n", "c": "a"}

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, tokens, position_ids, inference_context=None, runtime_gather_output=None):
        chars = CharTokenizer.CHARS
        logits = torch.zeros(*tokens.shape, 8)
        for char, successor in self.FIRST.items():
            logits[tokens == chars.index(char), chars.index(successor)] = 2.0
        logits[tokens == chars.index(":"), chars.index("c")] = 1.0
        return logits


@pytest.mark.parametrize("option, text", [
    (None, "ab:\n\n\n\n"),
    ("stop_on_eol", "ab:\n"),
    ("stop_on_double_eol", "ab:\n\n"),
    ("prevent_newline_after_colon", "ab:cab:"),
])
def test_newline_options(option, text):
    model = SuccessorModel().eval()
    server = TextGenerationServer(model, CharTokenizer(), GenerationLimits(
        eod_id=CharTokenizer.eod, vocab_size=CharTokenizer.vocab_size, max_sequence_length=16, max_batch_size=2))
    body = {"prompts": ["a", "c"], "tokens_to_generate": 6, "top_k": 1, "logprobs": True, "no_log": True}
    if option is not None:
        body[option] = True
    status, payload = server.handle(body)
    assert status == 200, payload
    assert payload["text"][0] == text
    assert len(payload["logprobs"][0]) == len(payload["tokens"][0]) - 1
    assert CharTokenizer.eod not in payload["tokens"][0]  # the stop's end-of-document token is not returned
    # The second prompt starts at "c" (c -> a), one step behind.
    assert payload["text"][1] == "c" + text[:len(payload["tokens"][1]) - 1]
    assert not model.training  # the served model stays in eval mode


def _served_at(tp, pp=1):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model = _model(tp, pp)
    body = {"prompts": PROMPTS, "tokens_to_generate": 5, "top_k": 1, "logprobs": True, "no_log": True}
    payload = None
    if torch.distributed.get_rank() == 0:
        server = TextGenerationServer(model, TOKENIZER, LIMITS)
        payload = server.handle(body)[1]
        payload["scored"] = server.handle({**body, "tokens_to_generate": 0})[1]["logprobs"]
        sampled = {**body, "top_k": 0, "temperature": 1.5, "random_seed": 9}
        payload["sampled"] = server.handle(sampled)[1]["tokens"]
        server.stop_followers()
    else:
        follow_requests(model, LIMITS)
    parallel_state.destroy_model_parallel()
    return payload


def _tp1_then_tp2():
    return _served_at(1), _served_at(2)


@pytest.mark.parametrize("world_size", [2])
def test_tp2_serves_the_greedy_text_of_tp1(world_size):
    (tp1, tp2), _ = run_on_ranks(world_size, _tp1_then_tp2)
    assert tp2["text"] == tp1["text"] and tp2["tokens"] == tp1["tokens"]
    for tp2_log_probs, tp1_log_probs in zip(tp2["logprobs"] + tp2["scored"], tp1["logprobs"] + tp1["scored"]):
        torch.testing.assert_close(torch.tensor(tp2_log_probs), torch.tensor(tp1_log_probs), atol=1e-5, rtol=0)


def _tp1_then_pp2():
    return _served_at(1), _served_at(1, pp=2)


@pytest.mark.parametrize("world_size", [2])
def test_pp2_serves_the_text_of_one_rank(world_size):
    # Rank 0, which serves, is the first pipeline stage: the tokens and log-probabilities come from the last.
    (one_rank, pp2), _ = run_on_ranks(world_size, _tp1_then_pp2)
    assert pp2["text"] == one_rank["text"] and pp2["tokens"] == one_rank["tokens"]
    assert pp2["sampled"] == one_rank["sampled"] and pp2["sampled"] != pp2["tokens"]
    for pp2_log_probs, one_rank_log_probs in zip(pp2["logprobs"] + pp2["scored"],
                                                 one_rank["logprobs"] + one_rank["scored"]):
        assert min(abs(value) for value in one_rank_log_probs) > 0.1
        torch.testing.assert_close(torch.tensor(pp2_log_probs), torch.tensor(one_rank_log_probs), atol=1e-6,
                                   rtol=0)

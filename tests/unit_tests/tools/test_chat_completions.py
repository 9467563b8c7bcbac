"""The chat endpoint of tools/run_text_generation_server.py (`POST /v1/chat/completions`): the conversation is
rendered as `tokenize_conversation(..., add_generation_prompt=True)` and broadcast as a `PUT /api` job is, the reply
is the generation of those tokens (greedy equal to `generate_in_batches` and to `PUT /api`, sampled with the
request's fields and seed), the end-of-turn marker ends it and is stripped, `usage` counts the tokens, every bad
field is a 400 naming it, a server without --chat-prompt-format says to give it, and PP2 serves one rank's reply."""

import json
import re
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.static_generation import generate_in_batches
from megatron.inference import text_generation_server
from megatron.inference.chat_request import parse_chat_request
from megatron.inference.generation_request import DEFAULT_TOKENS_TO_GENERATE, parse_generation_request
from megatron.inference.text_generation import GenerationLimits
from megatron.inference.text_generation_server import TextGenerationServer, follow_requests
from megatron.training.tokenizer.byte_level_tokenizer import ByteLevelTokenizer
from megatron.training.tokenizer.chat_prompt_formats import PROMPT_FORMATS, tokenize_conversation
from tests.unit_tests.models.gpt.gpt_test_utils import seeded_model, tiny_config
from tests.unit_tests.multiprocess_harness import run_on_ranks

TOKENIZER = ByteLevelTokenizer()
LIMITS = GenerationLimits(eod_id=TOKENIZER.eod, vocab_size=TOKENIZER.vocab_size, max_sequence_length=256,
                          max_batch_size=2)
CHATML = PROMPT_FORMATS["chatml"]
MODEL_NAME = "runs/tiny_gpt/sft/checkpoints"
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is os.sep?"}]
QUESTION = [{"role": "user", "content": "Hi"}]


def _model(pp=1):
    stage = {}
    if pp > 1:
        stage = dict(pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    return seeded_model(tiny_config(pp=pp, num_query_groups=2), position_embedding_type="rope",
                        vocab_size=TOKENIZER.vocab_size, max_sequence_length=LIMITS.max_sequence_length, **stage)


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def server(model):
    return TextGenerationServer(model, TOKENIZER, LIMITS, chat_format=CHATML, model_name=MODEL_NAME)


@pytest.fixture(scope="module")
def base_url(server):
    http_server = server.make_http_server("127.0.0.1", 0)
    thread = threading.Thread(target=http_server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{http_server.server_address[1]}"
    http_server.shutdown()
    http_server.server_close()


def _send(url, body, method="POST"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _prompt_tokens(messages, chat_format=CHATML):
    return tokenize_conversation(TOKENIZER, messages, chat_format, add_generation_prompt=True)[0]


def _generated(model, prompt_tokens, params, seed=1234):
    [result] = generate_in_batches(model, [prompt_tokens], params, eod_id=LIMITS.eod_id,
                                   max_sequence_length=LIMITS.max_sequence_length,
                                   max_batch_size=LIMITS.max_batch_size, vocab_size=LIMITS.vocab_size, seed=seed)
    return result


def test_greedy_reply_is_the_generation_of_the_rendered_conversation(model, base_url, monkeypatch):
    broadcast = []
    original_broadcast = text_generation_server.broadcast_from_rank0
    monkeypatch.setattr(text_generation_server, "broadcast_from_rank0",
                        lambda job=None: broadcast.append(job) or original_broadcast(job))
    before = int(time.time())
    status, answer = _send(base_url + "/v1/chat/completions",
                           {"model": "any", "messages": CONVERSATION, "max_tokens": 12, "temperature": 0})
    assert status == 200, answer
    prompt_tokens = _prompt_tokens(CONVERSATION)
    assert TOKENIZER.detokenize(prompt_tokens).endswith("<|im_end|>\n<|im_start|>assistant\n")
    # The job the other ranks follow is the rendered conversation.
    assert [job.prompt_tokens for job in broadcast] == [[prompt_tokens]]
    expected = _generated(model, prompt_tokens, SamplingParams(top_k=1, num_tokens_to_generate=12))
    assert not expected.stopped_at_eod and len(expected.generated_tokens) == 12
    assert answer["choices"] == [{"index": 0, "finish_reason": "length", "message": {
        "role": "assistant", "content": TOKENIZER.detokenize(expected.generated_tokens)}}]
    assert answer["usage"] == {"prompt_tokens": len(prompt_tokens), "completion_tokens": 12,
                               "total_tokens": len(prompt_tokens) + 12}
    assert answer["object"] == "chat.completion" and answer["model"] == MODEL_NAME
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", answer["id"])
    assert before <= answer["created"] <= time.time()
    # PUT /api continues the rendered text the same way.
    prompt = TOKENIZER.detokenize(prompt_tokens)
    status, api_answer = _send(base_url + "/api", {"prompts": [prompt], "tokens_to_generate": 12, "top_k": 1,
                                                   "no_log": True}, method="PUT")
    assert status == 200 and api_answer["text"][0] == prompt + answer["choices"][0]["message"]["content"]


def test_max_tokens_defaults_to_the_api_default(model, server):
    assert parse_chat_request({"messages": QUESTION}).max_tokens == DEFAULT_TOKENS_TO_GENERATE == 64
    assert parse_generation_request({"prompts": ["Hi"]}).tokens_to_generate == DEFAULT_TOKENS_TO_GENERATE
    status, answer = server.handle_chat({"messages": QUESTION, "temperature": 0})
    assert status == 200
    expected = _generated(model, _prompt_tokens(QUESTION), SamplingParams(top_k=1, num_tokens_to_generate=64))
    assert answer["usage"]["completion_tokens"] == len(expected.generated_tokens) == 64
    assert answer["choices"][0]["message"]["content"] == TOKENIZER.detokenize(expected.generated_tokens)


@pytest.mark.parametrize("fields, params", [
    ({"temperature": 1.5, "top_k": 20, "seed": 3}, SamplingParams(temperature=1.5, top_k=20)),
    ({"temperature": 0.8, "top_p": 0.9, "seed": 5}, SamplingParams(temperature=0.8, top_p=0.9)),
    ({"seed": 7}, SamplingParams(temperature=1.0)),  # OpenAI's defaults: temperature 1, top_p 1 (no filtering)
    ({"top_k": 1, "seed": 7}, SamplingParams(top_k=1)),
])
def test_sampling_fields_and_seed_reach_the_generation(model, server, fields, params):
    body = {"messages": QUESTION, "max_tokens": 8, **fields}
    status, answer = server.handle_chat(body)
    assert status == 200, answer
    params.num_tokens_to_generate = 8
    expected = _generated(model, _prompt_tokens(QUESTION), params, seed=fields["seed"])
    assert answer["choices"][0]["message"]["content"] == TOKENIZER.detokenize(expected.generated_tokens)
    assert server.handle_chat(body)[1]["choices"] == answer["choices"]  # the same seed, the same reply


class ScriptedReplyModel(torch.nn.Module):
    """Greedy decoding after a prompt of `prompt_length` tokens writes `reply` (token ids), then end-of-document."""

    def __init__(self, prompt_length, reply):
        super().__init__()
        self.prompt_length, self.reply = prompt_length, list(reply)
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, tokens, position_ids, inference_context=None, runtime_gather_output=None):
        batch, length = tokens.shape
        logits = torch.zeros(batch, length, TOKENIZER.vocab_size)
        for index in range(length):
            reply_index = inference_context.sequence_len_offset + index + 1 - self.prompt_length
            if reply_index >= 0:
                logits[:, index, self.reply[reply_index] if reply_index < len(self.reply) else TOKENIZER.eod] = 1.0
        return logits


@pytest.mark.parametrize("format_name, reply, max_tokens, content, finish_reason, completion_tokens", [
    # The marker ends the reply (the end-of-document token it forces is not counted) and is stripped.
    ("chatml", "Hello<|im_end|>\n<|im_start|>user\nagain", 40, "Hello", "stop", len("Hello<|im_end|>")),
    ("llama3", "Hi<|eot_id|><|start_header_id|>user", 40, "Hi", "stop", len("Hi<|eot_id|>")),
    ("plain", "Hi\n\nuser: more", 40, "Hi", "stop", len("Hi\n\n")),
    # The model's own end-of-document token ends it (and is counted).
    ("chatml", "Hello", 40, "Hello", "stop", len("Hello") + 1),
    # max_tokens ends it; when the last token completes the marker it is still a stop.
    ("chatml", "Hello<|im_end|>", 3, "Hel", "length", 3),
    ("chatml", "Hello<|im_end|>", len("Hello<|im_end|>"), "Hello", "stop", len("Hello<|im_end|>")),
])
def test_the_end_of_turn_marker_ends_the_reply_and_is_stripped(format_name, reply, max_tokens, content,
                                                              finish_reason, completion_tokens):
    chat_format = PROMPT_FORMATS[format_name]
    prompt_tokens = _prompt_tokens(QUESTION, chat_format)
    model = ScriptedReplyModel(len(prompt_tokens), TOKENIZER.tokenize(reply)).eval()
    server = TextGenerationServer(model, TOKENIZER, LIMITS, chat_format=chat_format)
    status, answer = server.handle_chat({"messages": QUESTION, "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, answer
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": content}
    assert answer["choices"][0]["finish_reason"] == finish_reason
    assert answer["usage"] == {"prompt_tokens": len(prompt_tokens), "completion_tokens": completion_tokens,
                               "total_tokens": len(prompt_tokens) + completion_tokens}


@pytest.mark.parametrize("body, message", [
    (["Hi"], r"^the request body must be a JSON object"),
    ({}, r"^messages is required"),
    ({"messages": []}, r"^messages: 'messages' must be a non-empty list"),
    ({"messages": "Hi"}, r"^messages: 'messages' must be a non-empty list"),
    ({"messages": [{"role": "user"}]}, r"^messages, message 0: each message needs a string 'content'"),
    ({"messages": [{"role": "bot", "content": "Hi"}]}, r"^messages, message 0: role 'bot' is not one of"),
    ({"messages": QUESTION, "max_tokens": 0}, r"^max_tokens must be an integer greater than or equal to 1$"),
    ({"messages": QUESTION, "max_tokens": "5"}, r"^max_tokens must be an integer"),
    ({"messages": QUESTION, "max_tokens": 250}, r"^messages \(52 tokens in the chatml chat format\) plus max_tokens "
                                                r"250 is longer than allowed: at most 256 tokens"),
    ({"messages": QUESTION, "temperature": -0.5}, r"^temperature must be a number from 0 \(greedy\) to 100"),
    ({"messages": QUESTION, "temperature": True}, r"^temperature must be a number"),
    ({"messages": QUESTION, "top_p": 0}, r"^top_p must be a number greater than 0 and at most 1.0"),
    ({"messages": QUESTION, "top_p": 1.5}, r"^top_p must be a number greater than 0 and at most 1.0"),
    ({"messages": QUESTION, "top_k": 1001}, r"^top_k must be an integer from 0 \(off\) to 1000$"),
    ({"messages": QUESTION, "top_k": 300}, r"^top_k 300 exceeds the tokenizer's vocabulary of 257 tokens$"),
    ({"messages": QUESTION, "top_k": 5, "top_p": 0.5}, r"^cannot set both top_k and top_p"),
    ({"messages": QUESTION, "seed": -1}, r"^seed must be a non-negative integer at most 18446744073709551615"),
    ({"messages": QUESTION, "stream": True}, r"^stream: streamed answers are not implemented"),
    ({"messages": QUESTION, "n": 2}, r"^n: this server answers with one choice"),
    ({"messages": QUESTION, "model": 3}, r"^model must be a string"),
    ({"messages": QUESTION, "max_completion_tokens": 5}, r"^unknown field\(s\) max_completion_tokens: the accepted "
                                                         r"fields are messages, model, max_tokens"),
])
def test_each_bad_field_is_a_400_naming_it(server, body, message):
    status, answer = server.handle_chat(body)
    assert status == 400 and set(answer) == {"message"}
    assert re.search(message, answer["message"]), answer["message"]


def test_without_a_chat_format_the_endpoint_says_to_launch_with_the_flag(model):
    status, answer = TextGenerationServer(model, TOKENIZER, LIMITS).handle_chat({"messages": QUESTION})
    assert status == 400
    assert answer["message"] == ("POST /v1/chat/completions needs the model's chat format: launch the server with "
                                 "--chat-prompt-format FORMAT (chatml, llama3, plain), the format the model was "
                                 "fine-tuned with (its --sft-tokenizer-prompt-format)")


def test_http_routes(base_url):
    chat_url = base_url + "/v1/chat/completions"
    status, answer = _send(chat_url, b"{not json")
    assert status == 400 and answer["message"].startswith("the request body is not JSON")
    status, answer = _send(chat_url, {"messages": QUESTION, "top_k": -1})
    assert status == 400 and answer["message"].startswith("top_k must be")
    for method in ("GET", "PUT"):
        status, answer = _send(chat_url, b"{}", method=method)
        assert status == 405 and answer["message"].startswith("use POST /v1/chat/completions with a JSON body")
    status, answer = _send(base_url + "/api", b"{}", method="POST")
    assert status == 405 and answer["message"] == 'use PUT /api with a JSON body, such as {"prompts": ["Hello"]}'
    status, answer = _send(base_url + "/v1/embeddings", b"{}")
    assert status == 404
    assert answer["message"] == ("no endpoint /v1/embeddings: use PUT /api or POST /v1/chat/completions or "
                                 "POST /v1/completions")


def served_at(pp, ask, **server_options):
    """At pipeline size `pp`: rank 0 serves the tiny model and returns `ask(server)`, the other ranks follow its
    requests (and return None)."""
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    model = _model(pp)
    answers = None
    if torch.distributed.get_rank() == 0:
        server = TextGenerationServer(model, TOKENIZER, LIMITS, **server_options)
        answers = ask(server)
        server.stop_followers()
    else:
        follow_requests(model, LIMITS)
    parallel_state.destroy_model_parallel()
    return answers


def _chat_served_at(pp):
    return served_at(pp, lambda server: [
        server.handle_chat({"messages": CONVERSATION, "max_tokens": 6, **fields})[1]["choices"]
        for fields in ({"temperature": 0}, {"temperature": 1.5, "seed": 9})], chat_format=CHATML)


def _one_rank_then_pp2():
    return _chat_served_at(1), _chat_served_at(2)


@pytest.mark.parametrize("world_size", [2])
def test_pp2_serves_the_reply_of_one_rank(world_size):
    (one_rank, pp2), _ = run_on_ranks(world_size, _one_rank_then_pp2)
    assert pp2 == one_rank and one_rank[0] != one_rank[1]

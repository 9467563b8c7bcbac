"""The JSON body of a chat request (`POST /v1/chat/completions`): OpenAI's fields, checked before any rank does
work. Pure Python: no model, tokenizer or process group.

Accepted fields (defaults): `messages` (required: a non-empty list of {"role", "content"}, roles system, user and
assistant), `max_tokens` (64, as `PUT /api`'s `tokens_to_generate`; at least 1), `temperature` (1.0, in
[0, 100]; 0 is greedy), `top_p` (1.0: no nucleus filtering; in (0, 1]), `top_k` (0: off; an extension, at most
1000, not with `top_p` below 1), `seed` (none: a fresh one each request; at most 2**64 - 1). OpenAI's `model` is
accepted and ignored (the server has one model), `stream` only as false and `n` only as 1. Any other field is
refused, so that a misspelt one is not silently ignored.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

from megatron.inference.generation_request import (
    DEFAULT_TOKENS_TO_GENERATE,
    MAX_RANDOM_SEED,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    RequestError,
)
from megatron.training.tokenizer.chat_prompt_formats import check_messages

FIELDS = ("messages", "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stream", "n")
EXAMPLE_BODY = '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}'


@dataclass(frozen=True)
class ChatRequest:
    messages: List[Dict[str, str]]
    max_tokens: int = DEFAULT_TOKENS_TO_GENERATE
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_chat_request(body) -> ChatRequest:
    """The request a JSON body asks for; raises RequestError (a 400) naming the first bad field."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, such as {EXAMPLE_BODY}")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(unknown)}: the accepted fields are {', '.join(FIELDS)}")
    if "messages" not in body:
        raise RequestError(f"messages is required: the conversation to answer, such as {EXAMPLE_BODY}")
    try:
        check_messages(body["messages"], "messages")
    except ValueError as error:
        raise RequestError(str(error)) from None
    if "model" in body and not isinstance(body["model"], str):
        raise RequestError("model must be a string (it is ignored: the server answers with the model it loaded)")
    if body.get("stream") is not None and body["stream"] is not False:
        raise RequestError("stream: streamed answers are not implemented by this server; leave stream out or false")
    if "n" in body and (not _is_int(body["n"]) or body["n"] != 1):
        raise RequestError("n: this server answers with one choice; leave n out or set it to 1")

    max_tokens = body.get("max_tokens", DEFAULT_TOKENS_TO_GENERATE)
    if not _is_int(max_tokens) or max_tokens < 1:
        raise RequestError("max_tokens must be an integer greater than or equal to 1")
    temperature = body.get("temperature", 1.0)
    if not _is_number(temperature) or not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise RequestError(f"temperature must be a number from 0 (greedy) to {MAX_TEMPERATURE}")
    top_p = body.get("top_p", 1.0)
    if not _is_number(top_p) or not 0.0 < top_p <= 1.0:
        raise RequestError("top_p must be a number greater than 0 and at most 1.0 (1.0: no nucleus filtering)")
    top_k = body.get("top_k", 0)
    if not _is_int(top_k) or not 0 <= top_k <= MAX_TOP_K:
        raise RequestError(f"top_k must be an integer from 0 (off) to {MAX_TOP_K}")
    if top_k > 0 and top_p < 1.0:
        raise RequestError("cannot set both top_k and top_p: set top_k or top_p, not both")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= MAX_RANDOM_SEED):
        raise RequestError(f"seed must be a non-negative integer at most {MAX_RANDOM_SEED} (2**64 - 1)")
    return ChatRequest(messages=list(body["messages"]), max_tokens=max_tokens, temperature=float(temperature),
                       top_p=float(top_p), top_k=top_k, seed=seed)

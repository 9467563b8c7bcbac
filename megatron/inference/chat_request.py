"""The JSON body of a chat request (`POST /v1/chat/completions`): OpenAI's fields, checked before any rank does
work. Pure Python: no model, tokenizer or process group.

Accepted fields: `messages` (required: a non-empty list of {"role", "content"}, roles system, user and assistant)
and the sampling fields of `openai_fields` (`max_tokens`, `temperature`, `top_p`, `top_k`, `seed`; `model`,
`stream`, `n`). Any other field is refused, so that a misspelt one is not silently ignored.
"""

from dataclasses import dataclass
from typing import Dict, List

from megatron.inference.generation_request import RequestError
from megatron.inference.openai_fields import SAMPLING_FIELDS, SamplingFields, check_body, parse_sampling_fields
from megatron.training.tokenizer.chat_prompt_formats import check_messages

FIELDS = ("messages",) + SAMPLING_FIELDS
EXAMPLE_BODY = '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}'


@dataclass(frozen=True, kw_only=True)
class ChatRequest(SamplingFields):
    messages: List[Dict[str, str]]


def parse_chat_request(body) -> ChatRequest:
    """The request a JSON body asks for; raises RequestError (a 400) naming the first bad field."""
    check_body(body, FIELDS, EXAMPLE_BODY)
    if "messages" not in body:
        raise RequestError(f"messages is required: the conversation to answer, such as {EXAMPLE_BODY}")
    try:
        check_messages(body["messages"], "messages")
    except ValueError as error:
        raise RequestError(str(error)) from None
    return ChatRequest(messages=list(body["messages"]), **parse_sampling_fields(body))

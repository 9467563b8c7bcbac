"""The JSON body of a text completion request (`POST /v1/completions`): OpenAI's fields, checked before any rank
does work. Pure Python: no model, tokenizer or process group.

Accepted fields: `prompt` (required: a string, or a list of 1 to 128 strings, one choice each), `stop` (none: a
string or a list of 1 to 4 non-empty strings that end a choice), the sampling fields of `openai_fields`
(`max_tokens`, `temperature`, `top_p`, `top_k`, `seed`; `model`, `stream`, `n`), `echo` only as false and
`logprobs` only as null. Any other field is refused, so that a misspelt one is not silently ignored.
"""

from dataclasses import dataclass
from typing import List, Tuple

from megatron.inference.generation_request import MAX_PROMPTS, RequestError
from megatron.inference.openai_fields import SAMPLING_FIELDS, SamplingFields, check_body, parse_sampling_fields

FIELDS = ("prompt", "stop", "echo", "logprobs") + SAMPLING_FIELDS
EXAMPLE_BODY = '{"prompt": "def hello():", "max_tokens": 32, "stop": ["\\n\\n"]}'
MAX_STOP_STRINGS = 4


@dataclass(frozen=True, kw_only=True)
class CompletionRequest(SamplingFields):
    prompts: List[str]
    stop: Tuple[str, ...] = ()
    single_prompt: bool = True  # `prompt` was a string, not a list (it names errors)


def _stop_strings(stop) -> Tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not 1 <= len(stops) <= MAX_STOP_STRINGS \
            or not all(isinstance(text, str) and text for text in stops):
        raise RequestError(f"stop must be a non-empty string or a list of 1 to {MAX_STOP_STRINGS} non-empty strings")
    return tuple(stops)


def parse_completion_request(body) -> CompletionRequest:
    """The request a JSON body asks for; raises RequestError (a 400) naming the first bad field."""
    check_body(body, FIELDS, EXAMPLE_BODY)
    if "prompt" not in body:
        raise RequestError(f"prompt is required: the text to continue, such as {EXAMPLE_BODY}")
    prompt = body["prompt"]
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not all(isinstance(text, str) for text in prompts):
        raise RequestError("prompt must be a string or a list of strings (token ids are not accepted)")
    if not 1 <= len(prompts) <= MAX_PROMPTS:
        raise RequestError(f"prompt must hold 1 to {MAX_PROMPTS} strings, got {len(prompts)}")
    stop = _stop_strings(body.get("stop"))
    if body.get("echo") not in (None, False):
        raise RequestError("echo: answers hold the generated text only; leave echo out or false")
    if body.get("logprobs") is not None:
        raise RequestError("logprobs: log-probabilities are not returned by this endpoint (PUT /api returns them); "
                           "leave logprobs out or null")
    return CompletionRequest(prompts=list(prompts), stop=stop, single_prompt=isinstance(prompt, str),
                             **parse_sampling_fields(body))

"""What OpenAI's chat and text completion requests (`chat_request`, `completion_request`) share: their sampling
fields, checked before any rank does work (`check_body`, `parse_sampling_fields`); the server's sampling parameters
and seed for them (`sampling_params_for`, `seed_for`); and the `usage` of an answer (`completion_token_count`,
`usage`).

Sampling fields (defaults): `max_tokens` (64, as `PUT /api`'s `tokens_to_generate`; at least 1), `temperature`
(1.0, in [0, 100]; 0 is greedy), `top_p` (1.0: no nucleus filtering; in (0, 1]), `top_k` (0: off; an extension, at
most 1000 and the vocabulary, not with `top_p` below 1), `seed` (none: a fresh one each request; at most
2**64 - 1). OpenAI's `model` is accepted and ignored (the server has one model), `stream` only as false and `n` only
as 1.
"""

import random
from dataclasses import dataclass
from typing import List, Optional

from megatron.core.inference.sampling_params import SamplingParams
from megatron.inference.generation_request import (
    DEFAULT_TOKENS_TO_GENERATE,
    MAX_RANDOM_SEED,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    RequestError,
)

SAMPLING_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stream", "n")


@dataclass(frozen=True)
class SamplingFields:
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


def check_body(body, fields, example_body):
    """Raise RequestError unless `body` is a JSON object of `fields` only."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, such as {example_body}")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(unknown)}: the accepted fields are {', '.join(fields)}")


def parse_sampling_fields(body: dict) -> dict:
    """The body's sampling fields (`SamplingFields` keywords); raises RequestError naming the first bad one."""
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
    return dict(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p), top_k=top_k, seed=seed)


def sampling_params_for(request: SamplingFields, vocab_size: int) -> SamplingParams:
    """OpenAI's sampling fields as the server's: temperature 0 is greedy (top_k 1), top_p 1.0 filters nothing.
    Raises RequestError when top_k exceeds the vocabulary."""
    if request.top_k > vocab_size:
        raise RequestError(f"top_k {request.top_k} exceeds the tokenizer's vocabulary of {vocab_size} tokens")
    if request.greedy:
        return SamplingParams(top_k=1, num_tokens_to_generate=request.max_tokens)
    return SamplingParams(temperature=request.temperature, top_k=request.top_k,
                          top_p=request.top_p if request.top_p < 1.0 else 0.0,
                          num_tokens_to_generate=request.max_tokens)


def seed_for(request: SamplingFields) -> int:
    """The request's seed, or a fresh one."""
    return request.seed if request.seed is not None else random.SystemRandom().randrange(2 ** 31)


def reply_tokens(result) -> List[int]:
    """The generated tokens without the end-of-document token that ended them."""
    return result.generated_tokens[:-1] if result.stopped_at_eod else result.generated_tokens


def ends_with_any(tokens: List[int], sequences) -> bool:
    return any(len(tokens) >= len(sequence) and tuple(tokens[len(tokens) - len(sequence):]) == tuple(sequence)
               for sequence in sequences)


def completion_token_count(result, stop_sequences) -> int:
    """The tokens the model generated: an end-of-document token counts when the model chose it, not when it
    followed one of `stop_sequences` (a `StopSequencesModel` forced it)."""
    forced = result.stopped_at_eod and ends_with_any(reply_tokens(result), stop_sequences)
    return len(result.generated_tokens) - int(forced)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}

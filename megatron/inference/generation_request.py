"""The JSON body of a text-generation request (`PUT /api`): upstream Megatron-LM's fields, defaults and limits,
checked before any rank does work. Pure Python: no model, tokenizer or process group.

Accepted fields (upstream's defaults): `prompts` (required, 1..128 strings), `tokens_to_generate` (64; 0 scores
the prompts and needs `logprobs`), `logprobs` (false), `temperature` (1.0, in (0, 100]), `top_k` (0, in
[0, 1000]), `top_p` (0.0, in [0, 1], not with `top_k`), `add_BOS` (false; needed for an empty prompt),
`top_p_decay` (0.0: top_p stays fixed; in [0, 1], needs `top_p`) and `top_p_bound` (0.0: no bound; in (0, top_p],
needs `top_p`): after each step top_p becomes max(top_p * top_p_decay, top_p_bound). `random_seed` (none: a fresh
seed each request; at most 2**64 - 1, a torch.Generator's range), `no_log` (false), `stop_on_eol`,
`stop_on_double_eol`, `prevent_newline_after_colon` (false), `top_n_logprobs` (0: none; the n most likely tokens
of every position `logprobs` covers, at most the vocabulary size).

Upstream fields refused here with a 400 (what they need is not implemented): `beam_width` (beam search) with
its `stop_token` and `length_penalty`.
Upstream's renamed fields `max_len` and `sentences` get upstream's messages. Any other field is refused too,
so that a misspelt one is not silently ignored.
"""

from dataclasses import dataclass
from typing import List, Optional

MAX_PROMPTS = 128
DEFAULT_TOKENS_TO_GENERATE = 64
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1000
# The largest seed a torch.Generator takes (an unsigned 64-bit integer).
MAX_RANDOM_SEED = 2 ** 64 - 1

RENAMED_FIELDS = {
    "max_len": "max_len is no longer used.  Replace with tokens_to_generate",
    "sentences": "sentences is no longer used.  Replace with prompts",
}
UNSUPPORTED_FIELDS = {
    "beam_width": "beam_width: beam search is not implemented by this server; leave beam_width out (greedy "
                  "decoding is top_k 1)",
    "stop_token": "stop_token: it is the end token of beam search, which this server does not implement; leave "
                  "it out (generation stops at the tokenizer's end-of-document token)",
    "length_penalty": "length_penalty: it scores beam search, which this server does not implement; leave it out",
}
FIELDS = ("prompts", "tokens_to_generate", "logprobs", "temperature", "top_k", "top_p", "top_p_decay", "top_p_bound",
          "add_BOS", "random_seed", "no_log", "stop_on_eol", "stop_on_double_eol", "prevent_newline_after_colon",
          "top_n_logprobs")


class RequestError(ValueError):
    """A request the server answers with 400 and this message."""


@dataclass(frozen=True)
class GenerationRequest:
    prompts: List[str]
    tokens_to_generate: int = DEFAULT_TOKENS_TO_GENERATE
    logprobs: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    top_p_decay: float = 0.0
    top_p_bound: float = 0.0
    add_BOS: bool = False
    random_seed: Optional[int] = None
    no_log: bool = False
    stop_on_eol: bool = False
    stop_on_double_eol: bool = False
    prevent_newline_after_colon: bool = False
    top_n_logprobs: int = 0


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _boolean(body, name):
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean value")
    return value


def _top_p_schedule(body, top_p):
    """(top_p_decay, top_p_bound) of the request, with upstream's checks and messages."""
    top_p_decay = body.get("top_p_decay", 0.0)
    if "top_p_decay" in body:
        if not _is_number(top_p_decay) or top_p_decay < 0.0:
            raise RequestError("top_p_decay must be a positive float less than or equal to 1.0")
        if top_p == 0.0:
            raise RequestError("top_p_decay cannot be set without top_p")
        if top_p_decay > 1.0:
            raise RequestError("top_p_decay must be less than or equal to 1.0")
    top_p_bound = body.get("top_p_bound", 0.0)
    if "top_p_bound" in body:
        if not _is_number(top_p_bound):
            raise RequestError("top_p_bound must be a positive float less than or equal to top_p")
        if top_p == 0.0:
            raise RequestError("top_p_bound cannot be set without top_p")
        if not 0.0 < top_p_bound <= top_p:
            raise RequestError("top_p_bound must be greater than 0 and less than top_p")
    return float(top_p_decay), float(top_p_bound)


def parse_generation_request(body) -> GenerationRequest:
    """The request a JSON body asks for; raises RequestError (a 400) naming the first bad field."""
    if not isinstance(body, dict):
        raise RequestError('the request body must be a JSON object, such as {"prompts": ["Hello"], '
                           '"tokens_to_generate": 16}')
    for name, message in {**RENAMED_FIELDS, **UNSUPPORTED_FIELDS}.items():
        if name in body:
            raise RequestError(message)
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(unknown)}: the accepted fields are {', '.join(FIELDS)}")
    if "prompts" not in body:
        raise RequestError("prompts argument required")
    prompts = body["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(prompt, str) for prompt in prompts):
        raise RequestError("prompts is not a list of strings")
    if len(prompts) == 0:
        raise RequestError("prompts is empty")
    if len(prompts) > MAX_PROMPTS:
        raise RequestError(f"Maximum number of prompts is {MAX_PROMPTS}")

    tokens_to_generate = body.get("tokens_to_generate", DEFAULT_TOKENS_TO_GENERATE)
    if not _is_int(tokens_to_generate) or tokens_to_generate < 0:
        raise RequestError("tokens_to_generate must be an integer greater than or equal to 0")
    logprobs = _boolean(body, "logprobs")
    if tokens_to_generate == 0 and not logprobs:
        raise RequestError("tokens_to_generate=0 implies logprobs should be True")

    temperature = body.get("temperature", 1.0)
    if not _is_number(temperature) or not 0.0 < temperature <= MAX_TEMPERATURE:
        raise RequestError(f"temperature must be a positive number less than or equal to {MAX_TEMPERATURE}")
    top_k = body.get("top_k", 0)
    if not _is_int(top_k) or not 0 <= top_k <= MAX_TOP_K:
        raise RequestError(f"top_k must be an integer equal to or greater than 0 and less than or equal to "
                           f"{MAX_TOP_K}")
    top_p = body.get("top_p", 0.0)
    if not _is_number(top_p) or not 0.0 <= top_p <= 1.0:
        raise RequestError("top_p must be a number from 0.0 to 1.0")
    if top_p > 0.0 and top_k > 0:
        raise RequestError("cannot set both top-k and top-p samplings: set top_k or top_p, not both")
    top_p_decay, top_p_bound = _top_p_schedule(body, top_p)

    add_bos = _boolean(body, "add_BOS")
    if not add_bos and any(len(prompt) == 0 for prompt in prompts):
        raise RequestError("Empty prompts require add_BOS=true")
    random_seed = body.get("random_seed")
    if random_seed is not None and (not _is_int(random_seed) or not 0 <= random_seed <= MAX_RANDOM_SEED):
        raise RequestError(f"random_seed must be a non-negative integer at most {MAX_RANDOM_SEED} (2**64 - 1)")
    top_n_logprobs = body.get("top_n_logprobs", 0)
    if not _is_int(top_n_logprobs) or top_n_logprobs < 0:
        raise RequestError("top_n_logprobs must be an integer greater than or equal to 0")
    return GenerationRequest(
        prompts=list(prompts), tokens_to_generate=tokens_to_generate, logprobs=logprobs,
        temperature=float(temperature), top_k=top_k, top_p=float(top_p), top_p_decay=top_p_decay,
        top_p_bound=top_p_bound, add_BOS=add_bos, random_seed=random_seed,
        no_log=_boolean(body, "no_log"), stop_on_eol=_boolean(body, "stop_on_eol"),
        stop_on_double_eol=_boolean(body, "stop_on_double_eol"),
        prevent_newline_after_colon=_boolean(body, "prevent_newline_after_colon"), top_n_logprobs=top_n_logprobs,
    )

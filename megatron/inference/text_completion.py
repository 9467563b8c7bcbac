"""One text completion request (`POST /v1/completions`), from its parsed fields (see `completion_request`) to
OpenAI's response, in the steps of `text_generation`:

- `prepare_completion_job` (the serving rank): tokenize each prompt as `PUT /api` does, check it fits,
  choose the seed; the `GenerationJob` is broadcast and every rank runs it with `run_job`, as a `PUT /api`
  request's;
- `build_text_completion` (the serving rank): `{"id", "object": "text_completion", "created", "model", "choices",
  "usage"}`, one choice per prompt, in order.

Generation of a choice stops at the end-of-document token, or once its tokens end with a `stop` string's own
tokens (a `StopSequencesModel` then leaves the end-of-document token as the only choice). The returned `text` is
the generated text cut before the first occurrence of any stop string, which is exact even when the model spelt a
stop string with other tokens (generation then went on to the end-of-document token or `max_tokens`, and the text
after the stop string is dropped). `finish_reason` is "stop" when the end-of-document token or a stop string ended
the choice, "length" otherwise. `usage` counts the prompts' tokens and the tokens the model generated (an
end-of-document token when the model chose it, not one a stop sequence forced), summed over the choices.
"""

import time
import uuid
from typing import List

from megatron.core.inference.static_generation import GeneratedSequence
from megatron.inference.completion_request import CompletionRequest
from megatron.inference.generation_request import RequestError
from megatron.inference.openai_fields import (
    completion_token_count,
    reply_tokens,
    sampling_params_for,
    seed_for,
    usage,
)
from megatron.inference.text_generation import GenerationJob, GenerationLimits, text_ids


def prepare_completion_job(request: CompletionRequest, tokenizer, limits: GenerationLimits) -> GenerationJob:
    """The job of `request`; raises RequestError (a 400) naming the field when it cannot run."""
    sampling_params = sampling_params_for(request, limits.vocab_size)
    prompt_tokens = []
    for index, prompt in enumerate(request.prompts):
        field = "prompt" if request.single_prompt else f"prompt[{index}]"
        try:
            tokens = list(tokenizer.tokenize(prompt))
        except ValueError as error:
            raise RequestError(f"{field} cannot be tokenized: {error}") from None
        if not tokens:
            raise RequestError(f"{field} has no tokens: give some text to continue")
        if len(tokens) + request.max_tokens > limits.max_sequence_length:
            raise RequestError(
                f"{field} ({len(tokens)} tokens) plus max_tokens {request.max_tokens} is longer than allowed: at most "
                f"{limits.max_sequence_length} tokens in all (the server's --inference-max-seq-length, at most "
                "--max-position-embeddings); shorten the prompt or ask for fewer max_tokens")
        prompt_tokens.append(tokens)
    stop_sequences = tuple(tuple(text_ids(tokenizer, stop)) for stop in request.stop)
    return GenerationJob(prompt_tokens=prompt_tokens, sampling_params=sampling_params, seed=seed_for(request),
                         logprobs=False, stop_sequences=tuple(sequence for sequence in stop_sequences if sequence))


def cut_at_stop(text: str, stops) -> tuple:
    """(`text` before the first occurrence of any of `stops`, whether one occurred)."""
    positions = [text.find(stop) for stop in stops if stop in text]
    return (text[:min(positions)], True) if positions else (text, False)


def build_text_completion(request: CompletionRequest, job: GenerationJob, results: List[GeneratedSequence],
                          tokenizer, model_name: str) -> dict:
    """OpenAI's text completion for the job's results (see the module docstring)."""
    choices, prompt_count, completion_count = [], 0, 0
    for index, result in enumerate(results):
        text, stopped = cut_at_stop(tokenizer.detokenize(reply_tokens(result)), request.stop)
        choices.append({"index": index, "text": text, "logprobs": None,
                        "finish_reason": "stop" if result.stopped_at_eod or stopped else "length"})
        prompt_count += len(result.prompt_tokens)
        completion_count += completion_token_count(result, job.stop_sequences)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": usage(prompt_count, completion_count),
    }

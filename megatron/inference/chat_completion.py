"""One chat request (`POST /v1/chat/completions`), from its parsed fields (see `chat_request`) to OpenAI's response,
in the steps of `text_generation`:

- `prepare_chat_job` (the serving rank): render the conversation in the server's chat format up to the assistant's
  header (`tokenize_conversation(..., add_generation_prompt=True)`, as the model saw its conversations in
  fine-tuning), check it fits, choose the seed; the `GenerationJob` is broadcast and every rank runs it with
  `run_job`, as a `PUT /api` request's;
- `build_chat_completion` (the serving rank): `{"id", "object": "chat.completion", "created", "model", "choices",
  "usage"}`.

Generation stops at the end-of-document token, or once the reply ends with the format's end-of-turn marker
(`ChatPromptFormat.reply_ends`: a `StopSequencesModel` then leaves the end-of-document token as the only choice).
The reply's `content` is the generated text without the end-of-document token and the marker; `finish_reason` is
"stop" when one of them ended it, "length" when `max_tokens` did. `usage` counts the prompt's tokens and the
tokens the model generated (a stop's end-of-document token when the model chose it, not one the marker forced).
"""

import random
import time
import uuid
from typing import List

from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.static_generation import GeneratedSequence
from megatron.inference.chat_request import ChatRequest
from megatron.inference.generation_request import RequestError
from megatron.inference.text_generation import GenerationJob, GenerationLimits, text_ids
from megatron.training.tokenizer.chat_prompt_formats import ChatPromptFormat, tokenize_conversation


def sampling_params_for(request: ChatRequest) -> SamplingParams:
    """OpenAI's sampling fields as the server's: temperature 0 is greedy (top_k 1), top_p 1.0 filters nothing."""
    if request.greedy:
        return SamplingParams(top_k=1, num_tokens_to_generate=request.max_tokens)
    return SamplingParams(temperature=request.temperature, top_k=request.top_k,
                          top_p=request.top_p if request.top_p < 1.0 else 0.0,
                          num_tokens_to_generate=request.max_tokens)


def prepare_chat_job(request: ChatRequest, tokenizer, limits: GenerationLimits,
                     chat_format: ChatPromptFormat) -> GenerationJob:
    """The job of `request`; raises RequestError (a 400) naming the field when it cannot run."""
    if request.top_k > limits.vocab_size:
        raise RequestError(f"top_k {request.top_k} exceeds the tokenizer's vocabulary of {limits.vocab_size} tokens")
    try:
        prompt_tokens, _ = tokenize_conversation(tokenizer, request.messages, chat_format, add_generation_prompt=True)
    except ValueError as error:
        raise RequestError(f"messages cannot be tokenized: {error}") from None
    if len(prompt_tokens) + request.max_tokens > limits.max_sequence_length:
        raise RequestError(
            f"messages ({len(prompt_tokens)} tokens in the {chat_format.name} chat format) plus max_tokens "
            f"{request.max_tokens} is longer than allowed: at most {limits.max_sequence_length} tokens in all (the "
            "server's --inference-max-seq-length, at most --max-position-embeddings); shorten the conversation or "
            "ask for fewer max_tokens")
    stop_sequences = tuple(tuple(text_ids(tokenizer, marker)) for marker in chat_format.reply_ends)
    seed = request.seed if request.seed is not None else random.SystemRandom().randrange(2 ** 31)
    return GenerationJob(prompt_tokens=[prompt_tokens], sampling_params=sampling_params_for(request), seed=seed,
                         logprobs=False, stop_sequences=tuple(sequence for sequence in stop_sequences if sequence))


def _ends_with_any(tokens: List[int], sequences) -> bool:
    return any(len(tokens) >= len(sequence) and tuple(tokens[len(tokens) - len(sequence):]) == tuple(sequence)
               for sequence in sequences)


def build_chat_completion(job: GenerationJob, result: GeneratedSequence, tokenizer, eod_id: int,
                          chat_format: ChatPromptFormat, model_name: str) -> dict:
    """OpenAI's chat completion for the job's one result (see the module docstring)."""
    generated = result.generated_tokens
    reply_tokens = generated[:-1] if result.stopped_at_eod else generated
    completion_tokens = len(generated)
    if result.stopped_at_eod and _ends_with_any(reply_tokens, job.stop_sequences):
        completion_tokens -= 1  # the end-of-document token the marker forced
    content = tokenizer.detokenize(reply_tokens)
    ended_turn = False
    for marker in chat_format.reply_ends:
        if marker and content.endswith(marker):
            content, ended_turn = content[:len(content) - len(marker)], True
            break
    prompt_tokens = len(result.prompt_tokens)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": "stop" if result.stopped_at_eod or ended_turn else "length"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }

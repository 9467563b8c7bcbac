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

import time
import uuid

from megatron.core.inference.static_generation import GeneratedSequence
from megatron.inference.chat_request import ChatRequest
from megatron.inference.generation_request import RequestError
from megatron.inference.openai_fields import (
    completion_token_count,
    reply_tokens,
    sampling_params_for,
    seed_for,
    usage,
)
from megatron.inference.text_generation import GenerationJob, GenerationLimits, text_ids
from megatron.training.tokenizer.chat_prompt_formats import ChatPromptFormat, tokenize_conversation


def prepare_chat_job(request: ChatRequest, tokenizer, limits: GenerationLimits,
                     chat_format: ChatPromptFormat) -> GenerationJob:
    """The job of `request`; raises RequestError (a 400) naming the field when it cannot run."""
    sampling_params = sampling_params_for(request, limits.vocab_size)
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
    return GenerationJob(prompt_tokens=[prompt_tokens], sampling_params=sampling_params, seed=seed_for(request),
                         logprobs=False, stop_sequences=tuple(sequence for sequence in stop_sequences if sequence))


def build_chat_completion(job: GenerationJob, result: GeneratedSequence, tokenizer, eod_id: int,
                          chat_format: ChatPromptFormat, model_name: str) -> dict:
    """OpenAI's chat completion for the job's one result (see the module docstring)."""
    content = tokenizer.detokenize(reply_tokens(result))
    ended_turn = False
    for marker in chat_format.reply_ends:
        if marker and content.endswith(marker):
            content, ended_turn = content[:len(content) - len(marker)], True
            break
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": "stop" if result.stopped_at_eod or ended_turn else "length"}],
        "usage": usage(len(result.prompt_tokens), completion_token_count(result, job.stop_sequences)),
    }

"""One text-generation request, from its parsed fields to upstream's response, in three steps:

- `prepare_job` (the serving rank): tokenize the prompts, check they fit, choose the seed; a `GenerationJob` holds
  everything the ranks need and nothing else (it is broadcast);
- `run_job` (every rank, together): generate with `megatron.core.inference` (static batches of at most
  `max_batch_size` prompts through a key/value cache), or score the prompts when no token is generated;
- `build_response` (the serving rank): upstream's `{"text", "segments", "logprobs", "tokens"}` (and
  `"top_n_logprobs"` when asked).

The response follows upstream's `generate_and_post_process`: `text[i]` is the prompt and its generation as one
string, `tokens[i]` their ids (the prompt's, with a leading end-of-document id under `add_BOS`, then the generated
ones, ending with the end-of-document id when generation reached it), `segments[i]` each of those ids detokenized
alone, and `logprobs[i]` (null unless asked) the log-probability of every token after the first under the model's
distribution (before temperature and filtering), one fewer than `tokens[i]`. `top_n_logprobs[i]` (only with
`top_n_logprobs` > 0) lists for the same positions the n most likely tokens under that distribution, each a
`{segment: log-probability}` object, most likely first (tokens that detokenize alike keep the likeliest entry).
"""

import random
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from megatron.core.inference.communication import broadcast_from_last_stage
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.pipeline_decoding import decode_forward
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.log_probs import target_log_probs, top_n_by_text, top_n_dicts, top_n_log_probs
from megatron.core.inference.static_generation import GeneratedSequence, generate_static_batch
from megatron.inference.generation_request import GenerationRequest, RequestError
from megatron.inference.newline_rules import NewlineRules, NewlineRulesModel, strip_forced_stop
from megatron.inference.stop_sequences import StopSequencesModel
from megatron.training.tokenizer import chat_prompt_formats


@dataclass(frozen=True)
class GenerationLimits:
    """What the server decodes: the tokenizer's end-of-document id and vocabulary size, the key/value cache's
    length (each prompt plus its generated tokens must fit) and batch size (more prompts run in several batches)."""

    eod_id: int
    vocab_size: int
    max_sequence_length: int
    max_batch_size: int


@dataclass(frozen=True)
class GenerationJob:
    """A request as every rank runs it. `sampling_params` None: score the prompts only. `stop_sequences`: token
    sequences that end a generated sequence (the chat endpoint's end-of-turn marker; see
    `megatron.inference.stop_sequences`)."""

    prompt_tokens: List[List[int]]
    sampling_params: Optional[SamplingParams]
    seed: int
    logprobs: bool
    newline_rules: Optional[NewlineRules] = None
    top_n_logprobs: int = 0
    stop_sequences: Tuple[Tuple[int, ...], ...] = ()


text_ids = chat_prompt_formats.text_ids  # the ids of a text alone, without a tokenizer's BOS / EOS


def _single_token(tokenizer, text, field):
    ids = text_ids(tokenizer, text)
    if field is not None and len(ids) != 1:
        raise RequestError(f"{field} needs a tokenizer that encodes {text!r} as one token; this one gives {ids}")
    return ids[0] if len(ids) == 1 else None


def newline_rules_for(request: GenerationRequest, tokenizer) -> Optional[NewlineRules]:
    """The request's newline options with the tokenizer's ids, or None when it sets none."""
    stop_field = "stop_on_eol" if request.stop_on_eol else "stop_on_double_eol" if request.stop_on_double_eol \
        else None
    colon_field = "prevent_newline_after_colon" if request.prevent_newline_after_colon else None
    if stop_field is None and colon_field is None:
        return None
    return NewlineRules(newline_id=_single_token(tokenizer, "\n", stop_field or colon_field),
                        double_newline_id=_single_token(tokenizer, "\n\n", None),
                        colon_id=_single_token(tokenizer, ":", colon_field),
                        stop_on_eol=request.stop_on_eol, stop_on_double_eol=request.stop_on_double_eol,
                        prevent_newline_after_colon=request.prevent_newline_after_colon)


def prepare_job(request: GenerationRequest, tokenizer, limits: GenerationLimits) -> GenerationJob:
    """The job of `request`; raises RequestError (a 400) naming the field when it cannot run."""
    if request.top_k > limits.vocab_size:
        raise RequestError(f"top_k {request.top_k} exceeds the tokenizer's vocabulary of {limits.vocab_size} tokens")
    if request.top_n_logprobs > limits.vocab_size:
        raise RequestError(f"top_n_logprobs {request.top_n_logprobs} exceeds the tokenizer's vocabulary of "
                           f"{limits.vocab_size} tokens")
    newline_rules = newline_rules_for(request, tokenizer)
    prompt_tokens = []
    for index, prompt in enumerate(request.prompts):
        try:
            tokens = list(tokenizer.tokenize(prompt))
        except ValueError as error:
            raise RequestError(f"prompts[{index}] cannot be tokenized: {error}") from None
        if request.add_BOS:
            tokens = [limits.eod_id] + tokens
        if not tokens:
            raise RequestError(f"prompts[{index}] has no tokens: give some text or set add_BOS=true")
        if len(tokens) + request.tokens_to_generate > limits.max_sequence_length:
            raise RequestError(
                f"prompts[{index}] ({len(tokens)} tokens) plus tokens_to_generate {request.tokens_to_generate} is "
                f"longer than allowed: at most {limits.max_sequence_length} tokens in all (the server's "
                "--inference-max-seq-length, at most --max-position-embeddings); shorten the prompt or ask for "
                "fewer tokens")
        prompt_tokens.append(tokens)
    sampling_params = None
    if request.tokens_to_generate > 0:
        sampling_params = SamplingParams(temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
                                         top_p_decay=request.top_p_decay, top_p_bound=request.top_p_bound,
                                         return_log_probs=request.logprobs,
                                         num_tokens_to_generate=request.tokens_to_generate,
                                         top_n_logprobs=request.top_n_logprobs,
                                         return_prompt_top_n_logprobs=request.top_n_logprobs > 0)
    seed = request.random_seed if request.random_seed is not None else random.SystemRandom().randrange(2 ** 31)
    return GenerationJob(prompt_tokens=prompt_tokens, sampling_params=sampling_params, seed=seed,
                         logprobs=request.logprobs, newline_rules=newline_rules,
                         top_n_logprobs=request.top_n_logprobs)


@torch.no_grad()
def score_prompts(model, prompts: List[List[int]], limits: GenerationLimits,
                  top_n: int = 0) -> List[GeneratedSequence]:
    """Log-probabilities of every prompt token after the first (and, with `top_n` > 0, the `top_n` most likely
    tokens of those positions), no token generated: one forward over each batch of right-padded prompts (the
    padding follows every real token, so under the causal mask it changes none)."""
    device = next(model.parameters()).device
    results = []
    was_training = model.training
    model.eval()
    try:
        for first in range(0, len(prompts), limits.max_batch_size):
            batch = prompts[first:first + limits.max_batch_size]
            length = max(len(prompt) for prompt in batch)
            tokens = torch.full((len(batch), length), limits.eod_id, dtype=torch.long, device=device)
            for row, prompt in enumerate(batch):
                tokens[row, :len(prompt)] = torch.tensor(prompt, dtype=torch.long, device=device)
            context = StaticInferenceContext(len(batch), length)
            logits = decode_forward(model, tokens, context)  # None on a pipeline stage before the last
            log_probs = torch.zeros(len(batch), length - 1, dtype=torch.float32, device=device)
            top_values = torch.zeros(len(batch), length - 1, top_n, dtype=torch.float32, device=device)
            top_ids = torch.zeros(len(batch), length - 1, top_n, dtype=torch.long, device=device)
            if logits is not None:
                log_probs = target_log_probs(logits[:, :-1], tokens[:, 1:], limits.vocab_size)
                if top_n > 0:
                    top_values, top_ids = top_n_log_probs(logits[:, :-1], top_n, limits.vocab_size)
            broadcast_from_last_stage(log_probs)
            if top_n > 0:
                broadcast_from_last_stage(top_values)
                broadcast_from_last_stage(top_ids)
            for row, prompt in enumerate(batch):
                scored = len(prompt) - 1
                result = GeneratedSequence(prompt_tokens=list(prompt), generated_tokens=[], stopped_at_eod=False,
                                           generated_log_probs=[], prompt_log_probs=log_probs[row, :scored].tolist())
                if top_n > 0:
                    result.generated_top_n_logprobs = []
                    result.prompt_top_n_logprobs = top_n_dicts(top_values[row, :scored], top_ids[row, :scored])
                results.append(result)
    finally:
        model.train(was_training)
    return results


def run_job(model, job: GenerationJob, limits: GenerationLimits) -> List[GeneratedSequence]:
    """Generate (or score) the job's prompts; every rank of the model (its tensor- and pipeline-parallel ranks)
    calls it with the same job, and every rank gets the same results."""
    if job.sampling_params is None:
        return score_prompts(model, job.prompt_tokens, limits, job.top_n_logprobs)
    results = []
    for first in range(0, len(job.prompt_tokens), limits.max_batch_size):
        batch = job.prompt_tokens[first:first + limits.max_batch_size]
        batch_model = model
        if job.newline_rules is not None:
            batch_model = NewlineRulesModel(model, job.newline_rules, [len(prompt) for prompt in batch],
                                            limits.eod_id)
        if job.stop_sequences:
            batch_model = StopSequencesModel(batch_model, job.stop_sequences, [len(prompt) for prompt in batch],
                                             limits.eod_id)
        results += generate_static_batch(batch_model, batch, job.sampling_params, eod_id=limits.eod_id,
                                         max_sequence_length=limits.max_sequence_length,
                                         max_batch_size=limits.max_batch_size, vocab_size=limits.vocab_size,
                                         seed=job.seed)
    return results


def build_response(job: GenerationJob, results: List[GeneratedSequence], tokenizer, eod_id: int) -> dict:
    """Upstream's response body for the job's results (see the module docstring)."""
    texts, segments, tokens, logprobs, top_n = [], [], [], [], []
    for result in results:
        generated = result.generated_tokens
        if job.newline_rules is not None:
            generated = strip_forced_stop(result.prompt_tokens, generated, job.newline_rules, eod_id)
        sequence = result.prompt_tokens + generated
        texts.append(tokenizer.detokenize(sequence))
        segments.append([tokenizer.detokenize([token]) for token in sequence])
        tokens.append(sequence)
        if job.logprobs:
            logprobs.append((result.prompt_log_probs + result.generated_log_probs)[:len(sequence) - 1])
        if job.top_n_logprobs > 0:
            positions = (result.prompt_top_n_logprobs + result.generated_top_n_logprobs)[:len(sequence) - 1]
            top_n.append(top_n_by_text(positions, tokenizer))
    response = {"text": texts, "segments": segments, "logprobs": logprobs if job.logprobs else None, "tokens": tokens}
    if job.top_n_logprobs > 0:
        response["top_n_logprobs"] = top_n
    return response


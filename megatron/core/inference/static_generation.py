"""Static-batch text generation: tokenized prompts of different lengths decoded together through a key/value cache.

All sequences of the batch sit at the same positions, so one causal cache serves them without padding masks:
the prefill runs the first `min(prompt lengths)` positions of every prompt at once, then each step feeds one
position. While a sequence is still inside its own prompt, the token placed at the next position is its prompt
token (the model's choice is ignored); afterwards it is the sampled token. A sequence stops after
`num_tokens_to_generate` new tokens (`num_tokens_total` minus its prompt's length when that is set) or at the
end-of-document token (`termination_id` when set), which it keeps as its last token; the others go on, and the
batch stops when every sequence has stopped.

Under tensor parallelism every rank gets the full logits from the model (it asks for them gathered,
`runtime_gather_output=True`, whatever the model's `parallel_output`); TP rank 0 samples and
broadcasts the tokens, so every rank of the group continues with the same sequence. Under pipeline parallelism
each step runs through the stages (`pipeline_decoding`, every stage caching its own layers) and only the last
stage has logits: its TP rank 0 samples, and the tokens are broadcast to every pipeline rank; the
log-probabilities are broadcast from the last stage once the batch is done. Sampling draws from a generator
seeded with `seed`: the same seed gives the same text. Under `top_p_decay` the nucleus shrinks after every step
(every position, as upstream's loop; `sampling.params_for_next_step`), starting from `top_p` in each batch.

Log-probabilities (`return_log_probs`) are those of the model's distribution over the real vocabulary (the
logits before temperature and filtering, without the padding rows of the vocabulary), for every prompt token
after the first (none under `skip_prompt_log_probs`) and every generated token; `top_n_logprobs` lists the most
likely tokens of the same positions under the same distribution.

`generate_in_batches` takes more prompts than one batch holds (`--inference-max-requests`) and generates them
in consecutive batches, one after the other.
"""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from megatron.core import parallel_state
from megatron.core.device_utils import get_device_for_group
from megatron.core.inference.communication import (
    broadcast_from_last_stage,
    broadcast_from_sampling_source,
    is_sampling_source,
)
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.log_probs import check_top_n, target_log_probs, top_n_dicts, top_n_log_probs
from megatron.core.inference.pipeline_decoding import decode_forward
from megatron.core.inference.sampling import params_for_next_step, sample_next_tokens
from megatron.core.inference.sampling_params import SamplingParams

# on_tokens(rows, tokens): the rows that generated a token in a step, and those tokens (--stream).
TokenCallback = Callable[[List[int], List[int]], None]


@dataclass
class GeneratedSequence:
    """One prompt's result. `generated_tokens` ends with the end-of-document id (`termination_id` when set) when
    `stopped_at_eod`. `prompt_log_probs[i]` is the log-probability of `prompt_tokens[i + 1]`; both lists are None
    unless asked (`prompt_log_probs` also under `skip_prompt_log_probs`).
    With `top_n_logprobs` n > 0, `generated_top_n_logprobs[i]` maps the n most likely ids at the position of
    `generated_tokens[i]` to their log-probabilities (most likely first), and `prompt_top_n_logprobs[i]` those at
    the position of `prompt_tokens[i + 1]`; both None otherwise."""

    prompt_tokens: List[int]
    generated_tokens: List[int]
    stopped_at_eod: bool
    generated_log_probs: Optional[List[float]] = None
    prompt_log_probs: Optional[List[float]] = None
    generated_top_n_logprobs: Optional[List[Dict[int, float]]] = None
    prompt_top_n_logprobs: Optional[List[Dict[int, float]]] = None


def check_prompts(prompts: Sequence[Sequence[int]], num_tokens_to_generate: int, max_sequence_length: int,
                  limit_flag: str = "--inference-max-seq-length"):
    """Raise ValueError naming the flag when a prompt cannot be generated from, whatever batch it is in.
    `limit_flag` names where `max_sequence_length` comes from (`--max-position-embeddings` when the model's
    positions, not the cache, are the limit)."""
    if limit_flag == "--inference-max-seq-length":
        remedy = "raise --inference-max-seq-length or "
    else:
        remedy = "the model has no positions past it: "
    if len(prompts) == 0:
        raise ValueError("--prompts: give at least one prompt")
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {index} is empty (no tokens): every prompt needs at least one token")
        if len(prompt) > max_sequence_length:
            raise ValueError(f"prompt {index} is {len(prompt)} tokens long, longer than {limit_flag} "
                             f"{max_sequence_length}: {remedy}shorten the prompt")
        if len(prompt) + num_tokens_to_generate > max_sequence_length:
            raise ValueError(f"prompt {index} ({len(prompt)} tokens) plus --num-tokens-to-generate "
                             f"{num_tokens_to_generate} exceeds {limit_flag} {max_sequence_length}: {remedy}"
                             "shorten the prompt or generate fewer tokens")


def check_prompts_for(prompts: Sequence[Sequence[int]], sampling_params: SamplingParams, max_sequence_length: int,
                      limit_flag: str = "--inference-max-seq-length"):
    """`check_prompts` for the length `sampling_params` asks for: `num_tokens_to_generate`, or `num_tokens_total`
    (prompt plus generated tokens), which must exceed every prompt and fit `max_sequence_length`."""
    total = sampling_params.num_tokens_total
    if total is None:
        check_prompts(prompts, sampling_params.num_tokens_to_generate, max_sequence_length, limit_flag)
        return
    if total > max_sequence_length:
        raise ValueError(f"num_tokens_total {total} exceeds {limit_flag} {max_sequence_length}: lower "
                         "num_tokens_total")
    for index, prompt in enumerate(prompts):
        if len(prompt) >= total:
            raise ValueError(f"prompt {index} is {len(prompt)} tokens long, not shorter than num_tokens_total "
                             f"{total} (prompt plus generated tokens): raise num_tokens_total or shorten the prompt")
    check_prompts(prompts, 0, max_sequence_length, limit_flag)


def check_static_batch(prompts: Sequence[Sequence[int]], sampling_params: SamplingParams, max_sequence_length: int,
                       max_batch_size: int):
    """Raise ValueError naming the flag when the prompts cannot be generated from in one static batch."""
    if len(prompts) > max_batch_size:
        raise ValueError(f"{len(prompts)} prompts but --inference-max-requests is {max_batch_size}: raise "
                         "--inference-max-requests or pass fewer prompts")
    check_prompts_for(prompts, sampling_params, max_sequence_length)


def _check_token_ids(prompts, eod_id, vocab_size, top_n=0):
    check_top_n(top_n, vocab_size)
    if not 0 <= eod_id < vocab_size:
        raise ValueError(f"the end-of-document id {eod_id} is outside the tokenizer's vocabulary of {vocab_size}")
    for index, prompt in enumerate(prompts):
        outside = [token for token in prompt if not 0 <= token < vocab_size]
        if outside:
            raise ValueError(f"prompt {index} holds token ids {outside[:5]} outside the tokenizer's vocabulary of "
                             f"{vocab_size}: tokenize the prompts with the model's tokenizer")


def _model_device(model):
    parameter = next(model.parameters(), None)
    if parameter is not None:
        return parameter.device
    # A pipeline stage may hold no parameters (no layers, neither embedding nor output layer).
    return get_device_for_group(parallel_state.get_pipeline_model_parallel_group())


def _stop_id(sampling_params: SamplingParams, eod_id: int, vocab_size: Optional[int]) -> int:
    """The id that ends a sequence: `termination_id` when set, else the end-of-document id."""
    stop_id = sampling_params.termination_id
    if stop_id is None:
        return eod_id
    if vocab_size is not None and stop_id >= vocab_size:
        raise ValueError(f"termination_id {stop_id} is outside the tokenizer's vocabulary of {vocab_size}: give "
                         "the id of a token generation can produce (None: the end-of-document id)")
    return stop_id


@torch.no_grad()
def generate_static_batch(model, prompts: Sequence[Sequence[int]], sampling_params: SamplingParams, *, eod_id: int,
                          max_sequence_length: int, max_batch_size: int, vocab_size: Optional[int] = None,
                          seed: int = 1234, on_tokens: Optional[TokenCallback] = None) -> List[GeneratedSequence]:
    """Generate from every prompt (token ids) of one static batch; see the module docstring.

    `model(tokens, position_ids, inference_context=context, runtime_gather_output=True)` must return logits
    `[b, s, vocab]` (all of the vocabulary on every tensor-parallel rank) for the positions offset .. offset + s - 1
    (GPTModel does, whatever its `parallel_output`). A GPTModel that is one stage of a pipeline decodes through
    `pipeline_decoding.decode_forward`: every pipeline rank calls this function with the same arguments and gets
    the same results. `max_sequence_length` / `max_batch_size` size the key/value cache
    (`--inference-max-seq-length`, `--inference-max-requests`); `vocab_size` is the tokenizer's vocabulary size
    (the model's may be padded; padding ids are never produced); None uses the model's whole vocabulary.
    `on_tokens(rows, tokens)`, when given, is called on every rank after each step that generated tokens, with the
    rows (prompt indices in this batch) that generated one and their new tokens (`--stream`).
    """
    sampling_params.check()  # the params may have been changed since they were made
    check_static_batch(prompts, sampling_params, max_sequence_length, max_batch_size)
    if vocab_size is not None:
        _check_token_ids(prompts, eod_id, vocab_size, sampling_params.top_n_logprobs)
    eod_id = _stop_id(sampling_params, eod_id, vocab_size)  # from here on, the id that ends a sequence
    device = _model_device(model)
    batch = len(prompts)
    lengths = torch.tensor([len(prompt) for prompt in prompts], device=device)
    num_tokens = torch.tensor([sampling_params.tokens_to_generate(len(prompt)) for prompt in prompts], device=device)
    total_length = int((lengths + num_tokens).max())
    tokens = torch.full((batch, total_length), eod_id, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = torch.tensor(list(prompt), dtype=torch.long, device=device)
    # token_log_probs[:, t]: log-probability of tokens[:, t] given the positions before it (t >= 1).
    token_log_probs = torch.zeros(batch, total_length, dtype=torch.float32, device=device)
    # top_values[:, t] / top_ids[:, t]: the top_n most likely tokens at position t (t >= 1) and their log-probs.
    top_n = sampling_params.top_n_logprobs
    top_values = torch.zeros(batch, total_length, top_n, dtype=torch.float32, device=device)
    top_ids = torch.zeros(batch, total_length, top_n, dtype=torch.long, device=device)
    generated_counts = torch.zeros(batch, dtype=torch.long, device=device)
    stopped = torch.zeros(batch, dtype=torch.bool, device=device)
    stopped_at_eod = torch.zeros(batch, dtype=torch.bool, device=device)
    context = StaticInferenceContext(max_batch_size, max_sequence_length)
    generator = torch.Generator(device=device).manual_seed(seed)
    step_params = sampling_params  # its top_p shrinks each step under top_p_decay
    was_training = model.training
    model.eval()
    try:
        start, end = 0, int(lengths.min())
        while True:
            # [b, end - start, vocab] on the last pipeline stage, None on the others.
            logits = decode_forward(model, tokens[:, start:end], context)
            context.increment_sequence_len_offset(end - start)
            if start == 0:
                context.enable_decode_mode()
            sampled = torch.empty(batch, dtype=torch.long, device=device)
            if is_sampling_source():
                last_logits = logits[:, -1, :vocab_size] if vocab_size is not None else logits[:, -1]
                sampled = sample_next_tokens(last_logits, step_params, generator)
            broadcast_from_sampling_source(sampled)
            step_params = params_for_next_step(step_params)

            in_prompt = lengths > end
            generating = ~in_prompt & ~stopped
            tokens[:, end] = torch.where(in_prompt, tokens[:, end], torch.where(stopped, eod_id, sampled))
            if sampling_params.return_log_probs and logits is not None:
                # Without the prompt's log-probs, the prefill needs only its last position's.
                first = end if sampling_params.skip_prompt_log_probs else start + 1
                token_log_probs[:, first:end + 1] = target_log_probs(logits[:, first - end - 1:],
                                                                     tokens[:, first:end + 1], vocab_size)
            if top_n > 0 and logits is not None:
                top_values[:, start + 1:end + 1], top_ids[:, start + 1:end + 1] = top_n_log_probs(logits, top_n,
                                                                                                  vocab_size)
            if on_tokens is not None and bool(generating.any()):
                rows = generating.nonzero().flatten()
                on_tokens(rows.tolist(), tokens[rows, end].tolist())
            generated_counts += generating.long()
            hit_eod = generating & (sampled == eod_id)
            stopped_at_eod |= hit_eod
            stopped |= hit_eod | (generating & (generated_counts >= num_tokens))
            if bool(stopped.all()):
                break
            start, end = end, end + 1
    finally:
        model.train(was_training)
    if sampling_params.return_log_probs:
        broadcast_from_last_stage(token_log_probs)
    if top_n > 0:
        broadcast_from_last_stage(top_values)
        broadcast_from_last_stage(top_ids)
    results = _results(prompts, tokens, lengths, generated_counts, stopped_at_eod, token_log_probs, sampling_params)
    if top_n > 0:
        for row, result in enumerate(results):
            length, count = int(lengths[row]), len(result.generated_tokens)
            result.prompt_top_n_logprobs = top_n_dicts(top_values[row, 1:length], top_ids[row, 1:length])
            result.generated_top_n_logprobs = top_n_dicts(top_values[row, length:length + count],
                                                          top_ids[row, length:length + count])
    return results


def _results(prompts, tokens, lengths, generated_counts, stopped_at_eod, token_log_probs, sampling_params):
    results = []
    for row, prompt in enumerate(prompts):
        length, count = int(lengths[row]), int(generated_counts[row])
        result = GeneratedSequence(prompt_tokens=list(prompt),
                                   generated_tokens=tokens[row, length:length + count].tolist(),
                                   stopped_at_eod=bool(stopped_at_eod[row]))
        if sampling_params.return_log_probs:
            if not sampling_params.skip_prompt_log_probs:
                result.prompt_log_probs = token_log_probs[row, 1:length].tolist()
            result.generated_log_probs = token_log_probs[row, length:length + count].tolist()
        results.append(result)
    return results


def generate_in_batches(model, prompts: Sequence[Sequence[int]], sampling_params: SamplingParams, *, eod_id: int,
                        max_sequence_length: int, max_batch_size: int, vocab_size: Optional[int] = None,
                        seed: int = 1234, on_tokens: Optional[TokenCallback] = None) -> List[GeneratedSequence]:
    """Generate from any number of prompts, `max_batch_size` (`--inference-max-requests`) at a time, as
    upstream's static engine does: consecutive prompts form each batch, and each batch is generated exactly as
    `generate_static_batch` would generate it alone (its own cache, its sampling generator seeded with `seed`).
    The results are in prompt order. Every prompt is checked before the first batch runs; `on_tokens` (see
    `generate_static_batch`) gets indices into `prompts`."""
    sampling_params.check()
    check_prompts_for(prompts, sampling_params, max_sequence_length)
    if max_batch_size < 1:
        raise ValueError(f"--inference-max-requests must be at least 1, got {max_batch_size}")
    if vocab_size is not None:
        _check_token_ids(prompts, eod_id, vocab_size, sampling_params.top_n_logprobs)
    _stop_id(sampling_params, eod_id, vocab_size)  # checked before the first batch runs
    results = []
    for first in range(0, len(prompts), max_batch_size):
        batch_callback = None if on_tokens is None else _offset_rows(on_tokens, first)
        results += generate_static_batch(model, prompts[first:first + max_batch_size], sampling_params,
                                         eod_id=eod_id, max_sequence_length=max_sequence_length,
                                         max_batch_size=max_batch_size, vocab_size=vocab_size, seed=seed,
                                         on_tokens=batch_callback)
    return results


def _offset_rows(on_tokens: TokenCallback, first: int) -> TokenCallback:
    """`on_tokens` for the batch that starts at prompt `first`: its rows as indices into all prompts."""
    def batch_callback(rows, tokens):
        on_tokens([first + row for row in rows], tokens)
    return batch_callback

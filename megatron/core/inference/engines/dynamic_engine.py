"""`DynamicInferenceEngine`: continuous batching over a `DynamicInferenceContext` (upstream's engine).

    context = DynamicInferenceContext(params_dtype=torch.float32, num_layers=..., kv_channels=...,
                                      num_attention_heads=<query groups>, max_sequence_length=...,
                                      buffer_size_gb=1.0, chunk_size_tokens=256)
    controller = TextGenerationController(GPTInferenceWrapper(model, wrapper_config, context), tokenizer)
    engine = DynamicInferenceEngine(controller, context, termination_id=tokenizer.eod, random_seed=1234)
    engine.add_request(0, "def ", sampling_params=SamplingParams(top_k=1, num_tokens_to_generate=20))
    while engine.has_unfinished_requests():
        active, finished, step_time = engine.step()

Requests arrive at any time (`add_request`) and wait until the context has room for their whole length (prompt
plus tokens to generate) and the step has room for their prompt; each `step` then runs, as one row, the whole
prompt of every request it admits and the last token of every running one, samples each request's next token
from the logits at its last row, and ends the requests that reached their length or the termination id (which
they keep as their last token, `stopped_at_eod`), giving their memory back. `generate(prompts, sampling_params)`
adds the prompts and steps until all are done. A request decodes as it would alone: the same tokens as the
static engine for greedy decoding (up to the order of fp32 sums between its kernels and a step's).

Sampling (temperature, top-k, top-p with `top_p_decay`) draws from a generator seeded with `random_seed` (else
torch's default generator), on tensor-parallel rank 0 of the last pipeline stage, whose tokens every rank
continues with; each pipeline stage runs its own layers (`pipeline_decoding.decode_forward`, the chunks of its
layers' keys and values only). Log-probabilities (`return_log_probs`, `skip_prompt_log_probs`), the top-n
log-probabilities (`top_n_logprobs`, `return_prompt_top_n_logprobs`) and `return_segments` fill the request's fields
as the static engine does (log-probabilities not under pipeline parallelism). Not here, each refused by name:
context parallelism, sequence parallelism, multi-latent attention (use the `StaticInferenceEngine` for those),
request pausing and CUDA graphs (`enable_cuda_graph` must stay False).
"""

import copy
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from megatron.core.inference.communication import (
    broadcast_from_sampling_source,
    is_sampling_source,
    pipeline_parallel_size,
)
from megatron.core.inference.inference_request import InferenceRequest, Status
from megatron.core.inference.log_probs import check_top_n, real_vocab_log_softmax, top_n_by_text, top_n_dicts
from megatron.core.inference.model_checks import check_inference_supported
from megatron.core.inference.pipeline_decoding import decode_forward
from megatron.core.inference.sampling import params_for_next_step, sample_next_tokens
from megatron.core.inference.sampling_params import SamplingParams


@dataclass
class DynamicInferenceRequest(InferenceRequest):
    """An `InferenceRequest` of continuous batching (upstream's name); `generated_tokens` grows step by step, up to
    `num_tokens_to_generate`."""

    num_tokens_to_generate: Optional[int] = None


class DynamicInferenceEngine:
    def __init__(self, controller, context, termination_id: Optional[int] = None, enable_cuda_graph: bool = False,
                 random_seed: Optional[int] = None):
        if enable_cuda_graph:
            raise ValueError("DynamicInferenceEngine(enable_cuda_graph=True): CUDA graphs are not supported here; "
                             "pass enable_cuda_graph=False")
        if not getattr(context, "is_dynamic_batching", lambda: False)():
            raise ValueError("DynamicInferenceEngine needs a DynamicInferenceContext (the StaticInferenceEngine "
                             "takes static batches)")
        self.controller, self.context = controller, context
        self.model = controller.inference_wrapped_model.model
        config = self.model.config
        check_inference_supported(config)  # context and sequence parallelism; a pipeline stage decodes its layers
        if getattr(config, "multi_latent_attention", False):
            raise ValueError("DynamicInferenceEngine: multi-latent attention is not supported with continuous "
                             "batching; generate with the StaticInferenceEngine")
        tokenizer = controller.tokenizer
        self.termination_id = tokenizer.eod if termination_id is None else termination_id
        self.vocab_size = tokenizer.vocab_size
        self.generator = None if random_seed is None else torch.Generator().manual_seed(random_seed)
        self.waiting: deque = deque()
        self.active: "OrderedDict[object, DynamicInferenceRequest]" = OrderedDict()
        self.step_params = {}  # request id -> the sampling params of its next token (top_p_decay moves them)
        self.step_count = 0

    # ---- requests ----------------------------------------------------------------------------------------------
    def add_request(self, request_id, prompt, num_tokens_to_generate: Optional[int] = None,
                    sampling_params: Optional[SamplingParams] = None) -> DynamicInferenceRequest:
        """Queue a request: `prompt` is text (tokenized by the controller) or token ids; it generates
        `num_tokens_to_generate` tokens (default: the sampling params')."""
        params = copy.deepcopy(sampling_params) if sampling_params is not None else SamplingParams()
        if num_tokens_to_generate is not None:
            params.num_tokens_to_generate, params.num_tokens_total = num_tokens_to_generate, None
        params.check()
        if pipeline_parallel_size() > 1 and (params.return_log_probs or params.top_n_logprobs):
            raise ValueError("DynamicInferenceEngine.add_request: log-probabilities (return_log_probs, "
                             "top_n_logprobs) are computed on the last pipeline stage only; with pipeline "
                             "parallelism generate them with the StaticInferenceEngine")
        if params.top_n_logprobs:
            check_top_n(params.top_n_logprobs, self.vocab_size)
        if params.return_segments:
            self.controller._check_segments()
        if isinstance(prompt, str):
            tokens = self.controller.tokenize_prompt(prompt, add_BOS=params.add_BOS)
        else:
            tokens = [int(token) for token in (prompt.tolist() if torch.is_tensor(prompt) else prompt)]
            prompt = self.controller.detokenize_generations(tokens)
        if any(request.request_id == request_id for request in self.waiting) or request_id in self.active:
            raise ValueError(f"DynamicInferenceEngine.add_request: request {request_id!r} is already queued")
        new_tokens = (params.num_tokens_total - len(tokens) if params.num_tokens_total is not None
                      else params.num_tokens_to_generate)
        self._check_fits(request_id, tokens, new_tokens)
        request = DynamicInferenceRequest(request_id=request_id, prompt=prompt, sampling_params=params,
                                          prompt_tokens=tokens, arrival_time=time.time(), generated_tokens=[],
                                          num_tokens_to_generate=new_tokens)
        self.waiting.append(request)
        return request

    def _check_fits(self, request_id, tokens, new_tokens):
        context = self.context
        if not tokens or new_tokens < 1:
            raise ValueError(f"request {request_id!r}: give a non-empty prompt and at least one token to generate")
        outside = [token for token in tokens if not 0 <= token < self.vocab_size]
        if outside:
            raise ValueError(f"request {request_id!r}: token ids {outside[:5]} are outside the tokenizer's "
                             f"vocabulary of {self.vocab_size}")
        if len(tokens) + new_tokens > context.max_sequence_length:
            raise ValueError(f"request {request_id!r}: {len(tokens)} prompt tokens + {new_tokens} to generate exceed "
                             f"the context's max_sequence_length {context.max_sequence_length}")
        if len(tokens) > context.max_tokens:
            raise ValueError(f"request {request_id!r}: its {len(tokens)} prompt tokens exceed the tokens of a step "
                             f"(max_tokens_override / max_sequence_length: {context.max_tokens})")
        if context.chunks_for(len(tokens) + new_tokens) > context.num_chunks:
            raise ValueError(f"request {request_id!r}: {len(tokens) + new_tokens} positions need more than the "
                             f"context's {context.num_chunks} chunks; raise buffer_size_gb")

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.active)

    def _admit(self) -> List[DynamicInferenceRequest]:
        """Move waiting requests in arrival order into the step while the context and the step's tokens have
        room (the first that does not fit waits, and so do the ones after it)."""
        admitted, budget = [], self.context.max_tokens - len(self.active)
        while self.waiting:
            request = self.waiting[0]
            total = len(request.prompt_tokens) + request.num_tokens_to_generate
            if len(request.prompt_tokens) > budget or not self.context.can_allocate(total):
                break
            self.waiting.popleft()
            self.context.allocate(request.request_id, total)
            budget -= len(request.prompt_tokens)
            request.status = Status.ACTIVE_AND_GENERATING_TOKENS
            self.step_params[request.request_id] = request.sampling_params
            admitted.append(request)
        return admitted

    # ---- one step ----------------------------------------------------------------------------------------------
    def step(self, sampling_params: Optional[SamplingParams] = None, *, verbose: bool = False
             ) -> Tuple[List[DynamicInferenceRequest], List[DynamicInferenceRequest], float]:
        """Run one step; returns (the requests still running, the requests finished in this step, its seconds).
        `sampling_params`, when given, replaces the sampling of every running request from this step on."""
        start = time.time()
        if sampling_params is not None:
            sampling_params.check()
            for request_id in self.step_params:
                self.step_params[request_id] = sampling_params
        running = list(self.active.values())
        admitted = self._admit()
        if not running and not admitted:
            if self.waiting:
                raise RuntimeError(f"request {self.waiting[0].request_id!r} cannot be admitted into an empty "
                                   "context; raise buffer_size_gb or max_tokens_override")
            return [], [], time.time() - start
        for request in admitted:
            self.active[request.request_id] = request
        requests = running + admitted
        entries = [(request.request_id, 1) for request in running]
        entries += [(request.request_id, len(request.prompt_tokens)) for request in admitted]
        tokens = [request.generated_tokens[-1] for request in running]
        for request in admitted:
            tokens.extend(request.prompt_tokens)
        device = next(self.model.parameters()).device
        self.context.initialize_step(entries)
        with torch.no_grad():  # the logits on the last pipeline stage, None on the others
            logits = decode_forward(self.model, torch.tensor([tokens], device=device), self.context)
        rows = self.context.last_token_rows()
        self.context.finish_step()
        next_tokens = self._sample(None if logits is None else logits[0, rows, :self.vocab_size], requests, device)
        log_probs = ([None] * len(requests) if logits is None
                     else self._log_probs(logits[0], requests, admitted, entries, rows, next_tokens))
        finished = [request for request, token, log_prob in zip(requests, next_tokens, log_probs)
                    if self._extend(request, token, log_prob)]
        self.step_count += 1
        if verbose:
            print(f"dynamic inference step {self.step_count}: {len(entries)} requests, {len(tokens)} tokens, "
                  f"{len(finished)} finished, {len(self.waiting)} waiting", flush=True)
        return list(self.active.values()), finished, time.time() - start

    def _sample(self, logits, requests, device) -> List[int]:
        """Each request's next token from its row of `logits` (`[requests, vocab]`; None off the last pipeline
        stage), drawn on the sampling source and the same on every rank."""
        chosen = torch.zeros(len(requests), dtype=torch.int64, device=device)
        if is_sampling_source():
            for index, request in enumerate(requests):
                params = self.step_params[request.request_id]
                chosen[index] = sample_next_tokens(logits[index:index + 1], params, self.generator)[0]
                self.step_params[request.request_id] = params_for_next_step(params)
        return broadcast_from_sampling_source(chosen).tolist()

    def _log_probs(self, logits, requests, admitted, entries, rows, next_tokens) -> List[Optional[float]]:
        """From the step's logits `[T, V]`, over the real vocabulary as the static engine's: with
        `return_log_probs` each request's log-probability of its next token (None for the others) and, for the
        requests admitted in this step unless `skip_prompt_log_probs`, those of their prompt tokens after the first
        (`prompt_log_probs`); with `top_n_logprobs` n the n most likely tokens of the next token's row
        (`generated_top_n_logprobs`) and, with `return_prompt_top_n_logprobs`, of the prompt's rows."""
        if not any(request.sampling_params.return_log_probs or request.sampling_params.top_n_logprobs
                   for request in requests):
            return [None] * len(requests)
        log_softmax = real_vocab_log_softmax(logits, self.vocab_size)
        starting = {id(request) for request in admitted}
        log_probs = []
        for request, row, (_, count), token in zip(requests, rows, entries, next_tokens):
            params, first = request.sampling_params, row - count + 1
            prompt_rows = log_softmax[first:first + len(request.prompt_tokens) - 1]
            if params.return_log_probs and id(request) in starting:
                request.generated_log_probs = []
                if not params.skip_prompt_log_probs:
                    targets = torch.tensor(request.prompt_tokens[1:], device=logits.device)
                    request.prompt_log_probs = prompt_rows.gather(-1, targets[:, None])[:, 0].tolist()
            if params.top_n_logprobs:
                if id(request) in starting:
                    request.generated_top_n_logprobs = []
                    if params.return_prompt_top_n_logprobs:
                        request.prompt_top_n_logprobs = top_n_dicts(*torch.topk(prompt_rows, params.top_n_logprobs))
                request.generated_top_n_logprobs += top_n_dicts(*torch.topk(log_softmax[row:row + 1],
                                                                            params.top_n_logprobs))
            log_probs.append(log_softmax[row, token].item() if params.return_log_probs else None)
        return log_probs

    def _extend(self, request, token, log_prob=None) -> bool:
        """Append `token` (and its log-probability); True (and the request COMPLETED, its memory given back) once it
        is done."""
        request.generated_tokens.append(token)
        if log_prob is not None:
            request.generated_log_probs.append(log_prob)
        stopped_at_eod = token == self._stop_id(request)
        if not stopped_at_eod and len(request.generated_tokens) < request.num_tokens_to_generate:
            return False
        request.stopped_at_eod = stopped_at_eod
        request.generated_length = len(request.generated_tokens)
        text_tokens = request.generated_tokens[:-1] if stopped_at_eod else request.generated_tokens
        request.generated_text = self.controller.detokenize_generations(text_tokens)
        params = request.sampling_params
        if params.return_segments:
            request.segments = self.controller.segments(text_tokens, request.generated_text)
        if params.top_n_logprobs:  # keyed by each token's text, as the static engine's
            tokenizer = self.controller.tokenizer
            request.generated_top_n_logprobs = top_n_by_text(request.generated_top_n_logprobs, tokenizer)
            if params.return_prompt_top_n_logprobs:
                request.prompt_top_n_logprobs = top_n_by_text(request.prompt_top_n_logprobs, tokenizer)
        request.status = Status.COMPLETED
        self.context.release(request.request_id)
        del self.active[request.request_id], self.step_params[request.request_id]
        return True

    def _stop_id(self, request) -> int:
        termination_id = request.sampling_params.termination_id
        return self.termination_id if termination_id is None else termination_id

    def generate(self, prompts: List, sampling_params: Optional[SamplingParams] = None
                 ) -> List[DynamicInferenceRequest]:
        """Add `prompts` (texts or token ids) as requests 0 .. n - 1 and step until all are done; returns them
        COMPLETED in prompt order."""
        if self.has_unfinished_requests():
            raise RuntimeError("DynamicInferenceEngine.generate runs its prompts alone: step the requests added with "
                               "add_request until has_unfinished_requests() is False first")
        requests = [self.add_request(index, prompt, sampling_params=sampling_params)
                    for index, prompt in enumerate(prompts)]
        while self.has_unfinished_requests():
            self.step()
        return requests

"""`TextGenerationController`: tokenizes prompts, generates a static batch of requests with a
`GPTInferenceWrapper`'s model and detokenizes the results (upstream's class; the decoding is
`static_generation.generate_in_batches`)."""

from collections import OrderedDict
from typing import List

from megatron.core.inference.inference_request import InferenceRequest, Status
from megatron.core.inference.log_probs import top_n_by_text
from megatron.core.inference.static_generation import check_prompts_for, generate_in_batches


class TextGenerationController:
    def __init__(self, inference_wrapped_model, tokenizer):
        self.inference_wrapped_model = inference_wrapped_model
        self.tokenizer = tokenizer

    def tokenize_prompt(self, prompt: str, add_BOS: bool = False) -> List[int]:
        """The prompt's token ids; with `add_BOS`, the tokenizer's beginning-of-sequence id first (once)."""
        tokens = list(self.tokenizer.tokenize(prompt))
        if not add_BOS:
            return tokens
        bos = getattr(self.tokenizer, "bos", None)
        if bos is None:
            raise ValueError(f"add_BOS: {type(self.tokenizer).__name__} has no beginning-of-sequence token (bos); "
                             "generate with add_BOS=False")
        while tokens and tokens[0] == bos:
            tokens.pop(0)
        return [bos] + tokens

    def detokenize_generations(self, tokens: List[int]) -> str:
        return self.tokenizer.detokenize(tokens)

    def segments(self, tokens: List[int], text: str) -> List[str]:
        """`text` (the detokenized `tokens`) cut where each token starts, by the tokenizer's `offsets`."""
        starts = list(self.tokenizer.offsets(tokens, text))
        return [text[start:end] for start, end in zip(starts, starts[1:] + [len(text)])]

    def _check_segments(self):
        try:
            self.tokenizer.offsets([], "")
        except NotImplementedError:
            raise ValueError(f"return_segments: {type(self.tokenizer).__name__} cannot tell where each token's text "
                             "starts (it has no offsets); generate with return_segments=False") from None
    def generate_all_output_tokens_static_batch(self, active_requests: "OrderedDict[str, InferenceRequest]",
                                                *, max_batch_size: int, seed: int):
        """Generate every request (all with the same sampling params), `max_batch_size` prompts at a time, and
        fill in their results; returns `active_requests`."""
        requests = list(active_requests.values())
        sampling_params = requests[0].sampling_params
        for request in requests[1:]:
            if request.sampling_params != sampling_params:
                raise ValueError(f"request {request.request_id} has other sampling_params than request "
                                 f"{requests[0].request_id}: a static batch is generated with one SamplingParams; "
                                 "call generate once per SamplingParams")
        wrapper = self.inference_wrapped_model
        max_sequence_length, limit_flag = wrapper.max_sequence_length()
        prompts = [request.prompt_tokens for request in requests]
        check_prompts_for(prompts, sampling_params, max_sequence_length, limit_flag)
        if sampling_params.return_segments:
            self._check_segments()
        results = generate_in_batches(wrapper.model, prompts, sampling_params, eod_id=self.tokenizer.eod,
                                      max_sequence_length=max_sequence_length, max_batch_size=max_batch_size,
                                      vocab_size=self.tokenizer.vocab_size, seed=seed)
        for request, result in zip(requests, results):
            text_tokens = result.generated_tokens[:-1] if result.stopped_at_eod else result.generated_tokens
            request.generated_tokens = result.generated_tokens
            request.generated_length = len(result.generated_tokens)
            request.generated_text = self.detokenize_generations(text_tokens)
            if sampling_params.return_segments:
                request.segments = self.segments(text_tokens, request.generated_text)
            request.stopped_at_eod = result.stopped_at_eod
            request.generated_log_probs = result.generated_log_probs
            request.prompt_log_probs = result.prompt_log_probs
            if sampling_params.top_n_logprobs > 0:
                request.generated_top_n_logprobs = top_n_by_text(result.generated_top_n_logprobs, self.tokenizer)
                if sampling_params.return_prompt_top_n_logprobs:
                    request.prompt_top_n_logprobs = top_n_by_text(result.prompt_top_n_logprobs, self.tokenizer)
            request.status = Status.COMPLETED
        return active_requests

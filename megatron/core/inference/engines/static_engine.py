"""`StaticInferenceEngine`: upstream's engine of static-batch generation over a `TextGenerationController`.

    model = GPTInferenceWrapper(gpt_model, InferenceWrapperConfig(hidden_size=..., ...,
                                                                  inference_max_requests=8))
    engine = StaticInferenceEngine(TextGenerationController(model, tokenizer))
    requests = engine.generate(prompts=["def ", "The path"],
                               sampling_params=SamplingParams(top_k=1, num_tokens_to_generate=20))

`generate` returns one COMPLETED `InferenceRequest` per prompt, in prompt order: consecutive prompts form batches
of `max_batch_size`, each generated as it would be alone (`static_generation.generate_in_batches`). Sampling
draws each `generate` call's seed from a generator seeded once with `random_seed` (the same engine
seed gives the same sequence of texts call after call), or without it from torch's default generator (so
`torch.manual_seed` before `generate` reproduces a sampled text). Under tensor or pipeline parallelism every
rank calls `generate` with the same arguments and gets the same requests.
"""

import time
import warnings
from collections import OrderedDict
from typing import List, Optional

import torch

from megatron.core.inference.inference_request import InferenceRequest
from megatron.core.inference.sampling_params import SamplingParams


class StaticInferenceEngine:
    def __init__(self, text_generation_controller, max_batch_size: Optional[int] = None,
                 random_seed: Optional[int] = None):
        config = text_generation_controller.inference_wrapped_model.inference_wrapper_config
        if max_batch_size is None:
            max_batch_size = config.inference_max_requests
        elif max_batch_size > config.inference_max_requests:
            warnings.warn(f"Engine `max_batch_size` ({max_batch_size}) > `inference_max_requests` in "
                          f"`inference_wrapper_config` ({config.inference_max_requests}); setting `max_batch_size` "
                          f"to {config.inference_max_requests}", UserWarning)
            max_batch_size = config.inference_max_requests
        if max_batch_size < 1:
            raise ValueError(f"StaticInferenceEngine: max_batch_size must be at least 1, got {max_batch_size}")
        self.text_generation_controller = text_generation_controller
        self.max_batch_size = max_batch_size
        self.random_seed = random_seed
        self._seed_generator = None if random_seed is None else torch.Generator().manual_seed(random_seed)

    def generate(self, prompts: Optional[List[str]] = None, add_BOS: bool = False,
                 encoder_prompts: Optional[List[str]] = None, common_inference_params: Optional[SamplingParams] = None,
                 sampling_params: Optional[SamplingParams] = None,
                 inference_requests: Optional[List[InferenceRequest]] = None) -> List[InferenceRequest]:
        """Generate from `prompts` (strings, tokenized by the controller) or from `inference_requests`; returns
        the completed requests in order. `common_inference_params` is the deprecated name of `sampling_params`
        (default: `SamplingParams()`, upstream's: sampling at temperature 1 from the whole distribution)."""
        if encoder_prompts is not None:
            raise ValueError("StaticInferenceEngine.generate: encoder_prompts are for encoder-decoder models; a GPT "
                             "model takes prompts only")
        if common_inference_params is not None:
            if sampling_params is not None and sampling_params != common_inference_params:
                raise ValueError("StaticInferenceEngine.generate: common_inference_params is the deprecated name of "
                                 "sampling_params; pass only sampling_params")
            warnings.warn("`common_inference_params` has been renamed to `sampling_params`.", DeprecationWarning)
            sampling_params = common_inference_params
        if (prompts is None) == (inference_requests is None):
            raise ValueError("StaticInferenceEngine.generate: pass prompts or inference_requests (one of them)")
        if prompts is not None:
            if isinstance(prompts, str) or not prompts:
                raise ValueError("StaticInferenceEngine.generate: prompts must be a non-empty list of strings, "
                                 f"got {prompts!r}")
            if sampling_params is None:
                sampling_params = SamplingParams()
            controller = self.text_generation_controller
            arrival_time = time.time()
            inference_requests = [
                InferenceRequest(request_id=str(index), prompt=prompt, sampling_params=sampling_params,
                                 prompt_tokens=controller.tokenize_prompt(prompt, add_BOS or sampling_params.add_BOS),
                                 arrival_time=arrival_time)
                for index, prompt in enumerate(prompts)]
        elif sampling_params is not None or add_BOS:
            raise ValueError("StaticInferenceEngine.generate: inference_requests carry their own sampling_params "
                             "and prompt_tokens; pass sampling_params / add_BOS only with prompts")
        if not inference_requests:
            raise ValueError("StaticInferenceEngine.generate: inference_requests is empty")
        seed = int(torch.randint(2 ** 62, (1,), generator=self._seed_generator))
        active = OrderedDict((request.request_id, request) for request in inference_requests)
        if len(active) != len(inference_requests):
            raise ValueError("StaticInferenceEngine.generate: two inference_requests share a request_id")
        self.text_generation_controller.generate_all_output_tokens_static_batch(
            active, max_batch_size=self.max_batch_size, seed=seed)
        return list(active.values())

"""`InferenceRequest`: one prompt of a `StaticInferenceEngine.generate` call and, once done, its result
(upstream's class and field names)."""

from dataclasses import dataclass
from enum import Enum
from typing import Dict, List, Optional

from megatron.core.inference.sampling_params import SamplingParams


class Status(Enum):
    WAITING_IN_QUEUE = 1
    ACTIVE_AND_GENERATING_TOKENS = 2
    ACTIVE_BUT_NOT_GENERATING_TOKENS = 3
    COMPLETED = 4


@dataclass
class InferenceRequest:
    """`prompt_tokens` as tokenized (with the BOS token under the engine's or the sampling params' `add_BOS`).
    Once COMPLETED: `generated_tokens` ends with the end-of-document id when generation reached it
    (`stopped_at_eod`), which `generated_text` leaves out;
    with `sampling_params.return_log_probs`, `prompt_log_probs[i]` is the log-probability of
    `prompt_tokens[i + 1]` (None under `skip_prompt_log_probs`) and `generated_log_probs[i]` that of
    `generated_tokens[i]`; with `sampling_params.return_segments`, `segments[i]` is the part of `generated_text` that
    `generated_tokens[i]` adds (their concatenation is `generated_text`); with
    `sampling_params.top_n_logprobs` n > 0, `generated_top_n_logprobs[i]` maps the n most likely tokens at the
    position of `generated_tokens[i]`, each detokenized alone, to their log-probabilities (most likely first), and
    with `return_prompt_top_n_logprobs` `prompt_top_n_logprobs[i]` those at the position of `prompt_tokens[i + 1]`."""

    request_id: str
    prompt: str
    sampling_params: SamplingParams
    prompt_tokens: List[int]
    arrival_time: Optional[float] = None
    status: Status = Status.WAITING_IN_QUEUE
    generated_text: Optional[str] = None
    generated_tokens: Optional[List[int]] = None
    generated_length: Optional[int] = None
    generated_log_probs: Optional[List[float]] = None
    prompt_log_probs: Optional[List[float]] = None
    stopped_at_eod: Optional[bool] = None
    generated_top_n_logprobs: Optional[List[Dict[str, float]]] = None
    prompt_top_n_logprobs: Optional[List[Dict[str, float]]] = None
    segments: Optional[List[str]] = None

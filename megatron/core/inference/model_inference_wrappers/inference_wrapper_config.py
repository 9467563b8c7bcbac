"""`InferenceWrapperConfig`: upstream's settings of an inference-wrapped model (names and defaults).

Here `inference_max_requests` (the key/value cache's batch size: more prompts run in several batches) and
`inference_max_seq_length` (the cache's length: a prompt plus its new tokens must fit, and fit the model's
`max_sequence_length`) size the generation. The other fields are kept for upstream's call sites; the model's own
config decides its dtype and residual precision, and no batch-times-length threshold switches the step's
communication on CPU/gloo.
"""

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class InferenceWrapperConfig:
    hidden_size: int
    inference_batch_times_seqlen_threshold: int
    padded_vocab_size: int
    params_dtype: torch.dtype
    fp32_residual_connection: bool = False
    inference_max_requests: int = 8
    inference_max_seq_length: int = 2560
    nccl_all_reduce_for_prefill: bool = False
    fp8: Optional[str] = None

    def add_attributes(self, attribute_value_pair: dict):
        """Set further attributes (upstream's helper)."""
        for key, value in attribute_value_pair.items():
            setattr(self, key, value)

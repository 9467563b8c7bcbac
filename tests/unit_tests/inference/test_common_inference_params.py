"""Upstream's older name `CommonInferenceParams` is `SamplingParams`, with its fields and checks."""

import pytest

from megatron.core.inference.common_inference_params import CommonInferenceParams
from megatron.core.inference.sampling_params import SamplingParams


def test_common_inference_params_is_sampling_params():
    assert CommonInferenceParams is SamplingParams
    params = CommonInferenceParams(temperature=0.5, top_p=0.9, num_tokens_to_generate=7, return_log_probs=True)
    assert (params.temperature, params.top_p, params.num_tokens_to_generate) == (0.5, 0.9, 7)
    with pytest.raises(ValueError, match="--top_k 2 and --top_p 0.9: set only one of them"):
        CommonInferenceParams(top_k=2, top_p=0.9)

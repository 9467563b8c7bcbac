"""`CommonInferenceParams`: upstream's older name of `SamplingParams`, kept so that code written against it runs."""

from megatron.core.inference.sampling_params import SamplingParams as CommonInferenceParams

__all__ = ["CommonInferenceParams"]

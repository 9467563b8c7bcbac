"""Upstream's model wrappers for the inference engine: `InferenceWrapperConfig` and `gpt.GPTInferenceWrapper`."""

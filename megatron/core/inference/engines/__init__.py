"""Upstream's inference engines: `StaticInferenceEngine` (static batches through a key/value cache). Upstream's
`DynamicInferenceEngine` (continuous batching) is not implemented."""

from megatron.core.inference.engines.static_engine import StaticInferenceEngine

__all__ = ["StaticInferenceEngine"]

"""Upstream's inference engines: `StaticInferenceEngine` (static batches through a key/value cache) and
`DynamicInferenceEngine` (continuous batching over a `DynamicInferenceContext`)."""

from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine, DynamicInferenceRequest
from megatron.core.inference.engines.static_engine import StaticInferenceEngine

__all__ = ["DynamicInferenceEngine", "DynamicInferenceRequest", "StaticInferenceEngine"]

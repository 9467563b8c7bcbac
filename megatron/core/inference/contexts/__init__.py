"""Inference contexts: what a forward pass needs to know when it decodes (upstream names)."""

from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron.core.inference.contexts.static_context import StaticInferenceContext

__all__ = ["DynamicInferenceContext", "StaticInferenceContext"]

"""`InferenceParams`: upstream's older name of the static-batch key/value cache context."""

from megatron.core.inference.contexts.static_context import StaticInferenceContext


class InferenceParams(StaticInferenceContext):
    """The key/value cache of static-batch decoding (see `StaticInferenceContext`)."""

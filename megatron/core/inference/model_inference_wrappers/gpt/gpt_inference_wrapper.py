"""`GPTInferenceWrapper`: a GPT model (a whole `GPTModel`, one pipeline stage of it, or a rank's virtual-pipeline
chunks) and the `InferenceWrapperConfig` that sizes its generation (upstream's class)."""

from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig


class GPTInferenceWrapper:
    def __init__(self, model, inference_wrapper_config: InferenceWrapperConfig, inference_context=None):
        if isinstance(model, (list, tuple)):
            raise ValueError(f"GPTInferenceWrapper takes one model, got a {type(model).__name__} of {len(model)}: "
                             "pass get_model(...)[0] (a virtual pipeline's chunks: wrap them in "
                             "megatron.inference.virtual_pipeline.VirtualPipelineModel)")
        dynamic = bool(getattr(inference_context, "is_dynamic_batching", lambda: False)())
        if inference_context is not None and not dynamic:
            raise ValueError("GPTInferenceWrapper: a static inference_context is not taken; every static batch gets "
                             "its own key/value cache, sized by InferenceWrapperConfig.inference_max_requests and "
                             "inference_max_seq_length (a DynamicInferenceContext is, for the "
                             "DynamicInferenceEngine)")
        for name in ("inference_max_requests", "inference_max_seq_length"):
            value = getattr(inference_wrapper_config, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"InferenceWrapperConfig.{name} must be a positive integer, got {value!r}")
        self.model = model
        self.inference_wrapper_config = inference_wrapper_config
        self.inference_context = inference_context  # a DynamicInferenceContext, or None

    def max_sequence_length(self):
        """(the longest prompt plus new tokens, what sets it): `inference_max_seq_length`, capped by the model's
        positions (`max_sequence_length`, --max-position-embeddings) as the generation scripts cap it."""
        limit = self.inference_wrapper_config.inference_max_seq_length
        positions = getattr(self.model, "max_sequence_length", None)
        if positions is not None and positions < limit:
            return positions, "--max-position-embeddings"
        return limit, "--inference-max-seq-length"

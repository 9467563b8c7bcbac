"""What decoding through a key/value cache supports, checked once per forward with a context.

Supported: tensor parallelism; pipeline parallelism, each stage decoding its own layers (`pipeline_decoding`);
an interleaved (virtual) pipeline, each rank decoding its model chunks one after the other
(`megatron.inference.virtual_pipeline.VirtualPipelineModel`); multi-head, grouped-query and multi-latent attention.
Refused, each with what to do instead:
- `GPTModel.forward` with a context on one stage of several: a stage's step runs through
  `pipeline_decoding.decode_forward`, which passes the activations between the stages;
- context parallelism: one step's positions are not split over ranks (`--context-parallel-size 1`; a
  `torch_dist` checkpoint trained with it loads without it);
- sequence parallelism: a decoding step of one position cannot be split over the tensor-parallel ranks; it
  changes no weight, so build the model without it.
"""

from megatron.core.transformer.transformer_config import TransformerConfig


def check_inference_supported(config: TransformerConfig, pre_process: bool = True, post_process: bool = True):
    """Raise ValueError naming the flag when a model built from `config` cannot decode through a cache."""
    if not (pre_process and post_process):
        raise ValueError(
            "GPTModel.forward with an inference context decodes a whole model, and this one is one stage of "
            f"--pipeline-model-parallel-size {config.pipeline_model_parallel_size}: decode a stage with "
            "megatron.core.inference.pipeline_decoding.decode_forward (generate_static_batch does), which passes "
            "the activations between the stages"
        )
    if config.context_parallel_size > 1:
        raise ValueError(
            f"generation needs --context-parallel-size 1 (got {config.context_parallel_size}): a decoding step is "
            "not split over ranks. A --ckpt-format torch_dist checkpoint trained with context parallelism loads "
            "at --context-parallel-size 1"
        )
    if config.sequence_parallel:
        raise ValueError(
            "generation needs a model built without --sequence-parallel: a decoding step of one position cannot "
            "be split over the tensor-parallel ranks (the weights are the same without it)"
        )

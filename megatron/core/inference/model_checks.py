"""What decoding through a key/value cache supports, checked once per forward with a context.

Pipeline parallelism is supported: each stage decodes its own layers (`pipeline_decoding`). Refused, each with
what to do instead:
- an interleaved (virtual) pipeline: a rank decodes one stage (a `torch_dist` checkpoint trained with virtual
  stages loads without them, it reshards on load);
- `GPTModel.forward` with a context on one stage of several: a stage's step runs through
  `pipeline_decoding.decode_forward`, which passes the activations between the stages;
- context parallelism: one step's positions are not split over ranks (same remedy, `--context-parallel-size 1`);
- sequence parallelism: a decoding step of one position cannot be split over the tensor-parallel ranks; it
  changes no weight, so build the model without it;
- multi-latent attention: its attention has no key/value cache here.
"""

from megatron.core.transformer.transformer_config import TransformerConfig


def check_inference_supported(config: TransformerConfig, pre_process: bool = True, post_process: bool = True):
    """Raise ValueError naming the flag when a model built from `config` cannot decode through a cache."""
    virtual_stages = getattr(config, "virtual_pipeline_model_parallel_size", None) or 1
    if virtual_stages > 1:
        raise ValueError(
            f"generation runs one pipeline stage per rank, not {virtual_stages} virtual stages: drop "
            "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank (a --ckpt-format "
            "torch_dist checkpoint trained with them loads without them)"
        )
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
    if config.multi_latent_attention:
        raise ValueError(
            "--multi-latent-attention: decoding with a key/value cache is not implemented for multi-latent "
            "attention; generate from a model with standard (multi-head or grouped-query) attention"
        )

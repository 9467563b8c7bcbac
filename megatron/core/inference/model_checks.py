"""What decoding through a key/value cache supports, checked once per forward with a context.

Refused, each with what to do instead:
- pipeline parallelism: one process must hold the whole model (a `torch_dist` checkpoint trained at any
  pipeline size loads at size 1, it reshards on load);
- context parallelism: one step's positions are not split over ranks (same remedy, `--context-parallel-size 1`);
- sequence parallelism: a decoding step of one position cannot be split over the tensor-parallel ranks; it
  changes no weight, so build the model without it;
- multi-latent attention: its attention has no key/value cache here.
"""

from megatron.core.transformer.transformer_config import TransformerConfig


def check_inference_supported(config: TransformerConfig, pre_process: bool = True, post_process: bool = True):
    """Raise ValueError naming the flag when a model built from `config` cannot decode through a cache."""
    if config.pipeline_model_parallel_size > 1 or not (pre_process and post_process):
        raise ValueError(
            f"generation needs --pipeline-model-parallel-size 1 (got {config.pipeline_model_parallel_size}): each "
            "process must hold the whole model. A --ckpt-format torch_dist checkpoint trained with pipeline "
            "parallelism loads at --pipeline-model-parallel-size 1 (it reshards on load); use tensor parallelism "
            "to split the model instead"
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

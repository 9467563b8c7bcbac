"""The normalisation layers a transformer uses, built from `config.normalization`.

The weights are identical on every tensor-parallel rank (`tensor_model_parallel=False`). With sequence
parallelism each rank normalises only its slice of the sequence, so its gradient is a partial sum; the
`sequence_parallel=True` attribute tells gradient finalisation to all-reduce it over the tensor-parallel group.
"""

import torch

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import parameter_device


def build_norm(config: TransformerConfig, hidden_size: int) -> torch.nn.Module:
    """A `torch.nn.LayerNorm` or `torch.nn.RMSNorm` over the last dimension, per `config.normalization`."""
    factory = {"device": parameter_device(config), "dtype": config.params_dtype}
    if config.normalization == "LayerNorm":
        norm = torch.nn.LayerNorm(hidden_size, eps=config.layernorm_epsilon, **factory)
    elif config.normalization == "RMSNorm":
        norm = torch.nn.RMSNorm(hidden_size, eps=config.layernorm_epsilon, **factory)
    else:
        raise ValueError(f"--normalization must be LayerNorm or RMSNorm, got {config.normalization!r}")
    for param in norm.parameters():
        param.tensor_model_parallel = False
        param.sequence_parallel = bool(config.sequence_parallel)
    return norm

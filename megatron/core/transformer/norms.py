"""The normalisation layers a transformer uses, built from `config.normalization`.

The weights are identical on every tensor-parallel rank (`tensor_model_parallel=False`). With sequence
parallelism each rank normalises only its slice of the sequence, so its gradient is a partial sum; the
`sequence_parallel=True` attribute tells gradient finalisation to all-reduce it over the tensor-parallel group.

With `layernorm_zero_centered_gamma` (`--apply-layernorm-1p`) the stored weight is gamma - 1: it starts at zero
and the layer scales by (1 + weight), so weight decay pulls the scale towards 1 rather than towards 0.
"""

import torch
import torch.nn.functional as F

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import parameter_device


class LayerNorm1P(torch.nn.LayerNorm):
    """LayerNorm whose weight holds gamma - 1 (zero-initialised); the bias is the usual beta."""

    def reset_parameters(self):
        super().reset_parameters()
        if self.elementwise_affine:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class RMSNorm1P(torch.nn.RMSNorm):
    """RMSNorm whose weight holds gamma - 1 (zero-initialised)."""

    def reset_parameters(self):
        super().reset_parameters()
        if self.elementwise_affine:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


_NORM_CLASSES = {
    ("LayerNorm", False): torch.nn.LayerNorm,
    ("LayerNorm", True): LayerNorm1P,
    ("RMSNorm", False): torch.nn.RMSNorm,
    ("RMSNorm", True): RMSNorm1P,
}


def norm_class(config: TransformerConfig) -> type:
    """The class `build_norm` builds for `config`."""
    found = _NORM_CLASSES.get((config.normalization, bool(config.layernorm_zero_centered_gamma)))
    if found is None:
        raise ValueError(f"--normalization must be LayerNorm or RMSNorm, got {config.normalization!r}")
    return found


def build_norm(config: TransformerConfig, hidden_size: int) -> torch.nn.Module:
    """A LayerNorm or RMSNorm over the last dimension, per `config.normalization` (zero-centred weights with
    `config.layernorm_zero_centered_gamma`)."""
    factory = {"device": parameter_device(config), "dtype": config.params_dtype}
    norm = norm_class(config)(hidden_size, eps=config.layernorm_epsilon, **factory)
    for param in norm.parameters():
        param.tensor_model_parallel = False
        param.sequence_parallel = bool(config.sequence_parallel)
    return norm

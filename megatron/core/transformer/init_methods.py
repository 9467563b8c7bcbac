"""Weight initialisers handed to layers as `init_method(tensor)` callables.

They are small frozen dataclasses rather than closures so a config that holds them can be pickled, compared
and printed.
"""

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NormalInit:
    """Fills a tensor in place from N(0, std^2)."""

    std: float

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=self.std)


def init_method_normal(std: float) -> NormalInit:
    """The default initialiser of every weight that is not an output projection."""
    return NormalInit(std)


def scaled_init_method_normal(std: float, num_layers: int) -> NormalInit:
    """Initialiser for the projections that write into the residual stream (attention out, MLP fc2).

    Each layer adds two such outputs to the residual, so their std is shrunk by sqrt(2 * num_layers) to keep the
    residual's variance from growing with depth.
    """
    return NormalInit(std / math.sqrt(2.0 * num_layers))


@dataclass(frozen=True)
class XavierUniformInit:
    """Fills a 2-D weight [out, in] from U(-a, a) with a = sqrt(6 / (in + out)) (`--init-method-xavier-uniform`).

    The layers call it on the full (unsharded) weight, so the bound does not depend on the tensor-parallel size.
    """

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.xavier_uniform_(tensor)

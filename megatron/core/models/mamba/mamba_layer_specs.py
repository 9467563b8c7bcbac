"""Upstream's `mamba_stack_spec` (`--spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec`). Layers
here are built from the config and the hybrid pattern, so the spec only names the hybrid stack."""

from dataclasses import dataclass


@dataclass(frozen=True)
class MambaStackSpec:
    """The hybrid stack of Mamba, attention and MLP layers (see `megatron.core.ssm.mamba_config`)."""


mamba_stack_spec = MambaStackSpec()

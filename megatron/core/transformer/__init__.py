"""Transformer building blocks: config, attention, MLP, layer and the stack of layers of one pipeline stage."""

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["MegatronModule", "TransformerConfig", "TransformerLayer"]


def __getattr__(name):
    if name == "TransformerLayer":  # imported on use: the layer pulls in attention, MLP and their extensions
        from megatron.core.transformer.transformer_layer import TransformerLayer

        return TransformerLayer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

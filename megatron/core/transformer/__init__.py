"""Transformer building blocks: config, attention, MLP, layer and the stack of layers of one pipeline stage."""

from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["TransformerConfig"]

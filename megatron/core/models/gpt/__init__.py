"""The GPT decoder-only language model."""

from megatron.core.models.gpt.gpt_model import GPTModel

__all__ = ["GPTModel"]

"""Inference examples: text generation from trained checkpoints."""

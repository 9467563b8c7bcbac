"""Transformers whose layers each have their own attention and MLP shapes (Llama-Nemotron's block configs)."""

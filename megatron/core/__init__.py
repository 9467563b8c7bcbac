"""Megatron-Core-style building blocks: parallel state, tensor-parallel layers, GPT model, optimizer, FSDP."""

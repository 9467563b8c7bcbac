"""Upstream's layer specs of heterogeneous GPT models."""

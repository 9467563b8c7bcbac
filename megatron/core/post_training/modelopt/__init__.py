"""Upstream's home of modelopt-specific model specs (see `gpt.model_specs`)."""

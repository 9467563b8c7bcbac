"""Inference-time state: the key/value cache of autoregressive decoding (`contexts`)."""

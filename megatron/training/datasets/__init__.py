"""Data loading for the training loop: samplers that split global batches across data-parallel ranks."""

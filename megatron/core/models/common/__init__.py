"""Pieces shared by the models: embeddings and position encodings."""

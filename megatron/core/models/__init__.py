"""Model definitions built from the transformer blocks (GPT)."""

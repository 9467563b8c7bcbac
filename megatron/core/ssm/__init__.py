"""State-space (Mamba-2) layers of hybrid models: the chunked scan, the mixer and the layer around it."""

"""FP8 training: formats, scaling recipes, FP8 tensors, the torch-native FP8 linear and the FP8 region.

Users import these through `megatron.core.fp8_utils`.
"""

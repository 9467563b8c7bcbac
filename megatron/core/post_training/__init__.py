"""Post-training (quantization, distillation, pruning, speculative decoding) support for nvidia-modelopt."""

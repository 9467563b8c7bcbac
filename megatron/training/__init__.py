"""The training driver: command-line arguments, `pretrain()`, checkpoints and training logs."""

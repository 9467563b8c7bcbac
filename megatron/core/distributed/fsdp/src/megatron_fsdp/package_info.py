"""Version and identity of the standalone Megatron-FSDP package."""

MAJOR = 0
MINOR = 1
PATCH = 0
__version__ = f"{MAJOR}.{MINOR}.{PATCH}"
__package_name__ = "megatron_fsdp"
__description__ = "Megatron-FSDP: fully sharded data parallelism (ZeRO-0..3) for PyTorch, on CPU and GPU"

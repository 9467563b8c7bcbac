"""Megatron-FSDP: fully sharded data parallelism (ZeRO-0..3) that runs on CPU (gloo) and GPU (NCCL)."""

from .package_info import __version__

"""Device choice for the distributed backend: CPU for gloo, the rank's GPU for NCCL, clear errors otherwise."""

import pytest
import torch

from megatron.training import accelerator


def test_gloo_runs_on_the_cpu():
    assert accelerator.device_for_backend("gloo", 3) == torch.device("cpu")


def test_nccl_without_a_gpu_names_the_flag(monkeypatch):
    monkeypatch.setattr(accelerator, "cuda_available", lambda: False)
    with pytest.raises(ValueError, match="--distributed-backend nccl needs a CUDA GPU.*--distributed-backend gloo"):
        accelerator.device_for_backend("nccl", 0)


def test_nccl_with_more_local_ranks_than_gpus(monkeypatch):
    monkeypatch.setattr(accelerator, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="local rank 1 has no GPU of its own: this node shows 1.*--nproc-per-node"):
        accelerator.device_for_backend("nccl", 1)

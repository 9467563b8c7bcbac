"""Where Megatron-FSDP keeps its buffers: `device=`, else the mesh's device type, else the device the data-parallel
group's backend serves on this machine's accelerator; and which collective implementation each device gets.

A GPU cannot be lent to these tests, so the accelerator is simulated by patching `torch.accelerator`: the
resolution logic is what is under test, not the device itself."""

import pytest
import torch

from megatron_fsdp import collectives, utils


@pytest.fixture
def fake_gpus(monkeypatch):
    """A machine with 8 CUDA devices whose current device is 0 (never set by the process)."""
    accelerator = torch.accelerator
    monkeypatch.setattr(accelerator, "is_available", lambda: True)
    monkeypatch.setattr(accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(accelerator, "device_count", lambda: 8)
    monkeypatch.setattr(accelerator, "current_device_index", lambda: 0)
    monkeypatch.setenv("LOCAL_RANK", "3")


def test_backend_strings_map_to_device_types():
    assert utils.backends_by_device_type("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert utils.backends_by_device_type("nccl") == {"cuda": "nccl"}
    assert utils.backends_by_device_type("gloo") == {"cpu": "gloo"}
    # no accelerator here: a mixed backend keeps tensors on the CPU
    assert utils.device_type_for_backend("cpu:gloo,cuda:nccl") == "cpu"
    assert utils.resolve_device(backend="gloo") == torch.device("cpu")


def test_mixed_backend_on_a_gpu_machine_uses_the_gpu(fake_gpus):
    # init_process_group() with no backend, or "cpu:gloo,cuda:nccl": the GPU, not the CPU with gloo
    for backend in ("cpu:gloo,cuda:nccl", "nccl"):
        assert utils.resolve_device(backend=backend) == torch.device("cuda", 3)
    assert utils.resolve_device(backend="gloo") == torch.device("cpu")
    # the mesh's device type wins over the backend, and device= over both
    assert utils.resolve_device(None, "cpu", "cpu:gloo,cuda:nccl") == torch.device("cpu")
    assert utils.resolve_device(None, "cuda", "gloo") == torch.device("cuda", 3)
    assert utils.resolve_device("cuda:5", "cpu", "gloo") == torch.device("cuda", 5)


def test_device_index_follows_local_rank_not_the_default_current_device(fake_gpus, monkeypatch):
    # CUDA already initialised with current device 0 must not put local rank 3 on GPU 0
    assert utils.current_accelerator_device("cuda") == torch.device("cuda", 3)
    monkeypatch.setenv("LOCAL_RANK", "11")  # 8 visible devices: one per local rank, modulo what is visible
    assert utils.current_accelerator_device("cuda") == torch.device("cuda", 3)
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 6)
    assert utils.current_accelerator_device("cuda") == torch.device("cuda", 6)


def test_accelerator_backend_without_accelerator_names_the_fix():
    with pytest.raises(RuntimeError, match="no cuda accelerator; pass device="):
        utils.resolve_device(backend="nccl")


def test_device_for_group_reads_the_mixed_backend(fake_gpus, monkeypatch):
    monkeypatch.setattr(collectives, "backend_of", lambda group: "cpu:gloo,cuda:nccl")
    assert collectives.device_for_group(object()) == torch.device("cuda", 3)
    group = object()
    # per tensor device: NCCL's stock collectives for GPU tensors, gloo's point-to-point path for CPU tensors
    assert collectives.backend_for(group, torch.device("cuda", 3)) == "nccl"
    assert collectives.backend_for(group, torch.device("cpu")) == "gloo"
    assert collectives._point_to_point(group, torch.zeros(1))
    monkeypatch.setattr(collectives, "GLOO_POINT_TO_POINT", False)
    assert not collectives._point_to_point(group, torch.zeros(1))

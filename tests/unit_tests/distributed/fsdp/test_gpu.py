"""Megatron-FSDP on CUDA with NCCL: training equals a single-process reference, the buffers and side streams live
on the GPU, and the peak of `torch.cuda.max_memory_allocated` stays close to torch FSDP2's on the same model.

The ranks of the test pool join a gloo group; each test builds an NCCL group over them and hands Megatron-FSDP a
CUDA device mesh on it, one GPU per rank (so a world size needs that many GPUs)."""

import pytest
import torch
import torch.nn as nn

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS = 3
WIDE, DEPTH, TOKENS = 1024, 4, 2048


def _needs_gpus(world_size):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} CUDA devices, this machine has {torch.cuda.device_count()}")


def _nccl_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    torch.cuda.set_device(dist.get_rank())
    group = dist.new_group(backend="nccl")
    return DeviceMesh.from_group(group, "cuda", mesh_dim_names=("dp",))


def _train_on_gpu(strategy, dtype):
    import torch.distributed as dist

    import megatron_fsdp

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank)
    module = models.make_model(0, dtype)
    optimizer = models.make_optimizer([p for p in module.parameters() if p.requires_grad])
    model, optimizer = megatron_fsdp.fully_shard(module, optimizer, device_mesh=_nccl_mesh(),
                                                 fsdp_unit_modules=[models.Block], zero_dp_strategy=strategy)
    placement = (model.device.type, model.schedule.streams.enabled,
                 {group.compute_buffer.device.type for group in model.groups})
    losses = []
    batches = models.make_batches(NUM_STEPS + 1, dtype=dtype)
    for step, (inputs, target) in enumerate(batches):
        inputs, target = (models.local_slice(t, rank, world).to(device) for t in (inputs, target))
        loss = models.loss_fn(model(inputs), target)
        total = loss.detach().double()
        dist.all_reduce(total, group=model.topology.dp_group)
        losses.append(total.item() / world)
        if step < NUM_STEPS:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return losses, placement


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_nccl_training_matches_single_process(world_size):
    _needs_gpus(world_size)
    reference, _ = models.reference_losses(NUM_STEPS)
    reference_bf16 = models.reference_losses_mixed(NUM_STEPS)
    for strategy in range(4):
        losses, placement = run_on_ranks(world_size, _train_on_gpu, strategy, torch.float32)[0]
        assert placement == ("cuda", True, {"cuda"}), placement
        # GPU kernels sum in another order than the CPU reference: 1e-4 instead of the CPU tests' 1e-5
        assert losses == pytest.approx(reference, abs=1e-4), strategy
        bf16_losses, _ = run_on_ranks(world_size, _train_on_gpu, strategy, torch.bfloat16)[0]
        assert bf16_losses == pytest.approx(reference_bf16, abs=2e-2), strategy


class WideBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDE, 4 * WIDE)
        self.down = nn.Linear(4 * WIDE, WIDE)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def _wide_model():
    torch.manual_seed(0)
    return nn.Sequential(*[WideBlock() for _ in range(DEPTH)])


def _peak_of_steps(model, optimizer, device):
    inputs = torch.randn(TOKENS, WIDE, device=device, generator=torch.Generator(device).manual_seed(1))
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(2):
        optimizer.zero_grad()
        model(inputs).square().mean().backward()
        optimizer.step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def _peak_memory_against_fsdp2():
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import megatron_fsdp

    device = torch.device("cuda", dist.get_rank())
    mesh = _nccl_mesh()
    module = _wide_model()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    model, optimizer = megatron_fsdp.fully_shard(module, optimizer, device_mesh=mesh, fsdp_unit_modules=[WideBlock],
                                                 zero_dp_strategy=3)
    ours = _peak_of_steps(model, optimizer, device)
    del model, optimizer, module
    torch.cuda.empty_cache()

    module = _wide_model().to(device)
    for block in module:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    theirs = _peak_of_steps(module, torch.optim.AdamW(module.parameters(), lr=1e-3), device)
    return ours, theirs


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_peak_memory_close_to_fsdp2(world_size):
    _needs_gpus(world_size)
    for ours, theirs in run_on_ranks(world_size, _peak_memory_against_fsdp2):
        # Same model, units and optimizer; Megatron-FSDP keeps fp32 main weights beside the compute weights only
        # when their dtypes differ (not here), so the peaks must be close: within 20% of FSDP2's.
        assert ours <= 1.2 * theirs, (ours, theirs)

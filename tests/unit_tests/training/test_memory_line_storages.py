"""The memory line's params + grads + optimizer state equal the bytes of the storages this rank actually holds
for the model and optimizer, found by walking their objects (not from a formula), under every data-parallel
wrapper, in fp32 and bf16, on DP2."""

import types

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.multiprocess_harness import run_on_ranks

# Storages hold a little more than the line counts: bucket and shard padding, and the model's own buffers
# (e.g. position ids); well under 1% for this model.
TOLERANCE = 0.01

WRAPPERS = {
    "ddp": dict(),
    "distributed_optimizer": dict(use_distributed_optimizer=True),
    "megatron_fsdp_z1": dict(use_megatron_fsdp=True, use_distributed_optimizer=True,
                             data_parallel_sharding_strategy="optim"),
    "megatron_fsdp_z3": dict(use_megatron_fsdp=True, use_distributed_optimizer=True,
                             data_parallel_sharding_strategy="optim_grads_params"),
    "torch_fsdp2": dict(use_torch_fsdp2=True),
}


def held_storage_bytes(*roots):
    """Bytes of every distinct storage reachable from `roots` through Python attributes, containers, tensor
    attributes (`main_grad`) and `.grad`, not into Python modules (global state such as RNG trackers); a
    DTensor counts its local tensor. Each storage is counted once."""
    from torch.distributed.tensor import DTensor

    seen_objects, storages = set(), {}
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects or obj is None or isinstance(
                obj, (str, bytes, int, float, bool, type, types.ModuleType)):
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            local = obj.to_local() if isinstance(obj, DTensor) else obj
            if not local.is_meta:
                storage = local.untyped_storage()
                storages[(local.device, storage.data_ptr())] = storage.nbytes()
            stack.append(obj.grad)
            stack.extend(obj.__dict__.values())
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and not callable(obj) or isinstance(obj, torch.nn.Module):
            stack.extend(vars(obj).values())
    return sum(storages.values())


def _line_versus_storages(wrapper, bf16):
    from megatron.core.distributed import DistributedDataParallelConfig, wrap_data_parallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.training.training_log import memory_usage
    from tests.unit_tests.distributed.precision_gpt import build_gpt, gpt_batch, gpt_loss

    fields = WRAPPERS[wrapper]
    model = build_gpt(bf16=bf16, untie=wrapper == "torch_fsdp2")
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=bf16, **fields)
    chunk = wrap_data_parallel(model.config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-3, bf16=bf16, use_distributed_optimizer=fields.get("use_distributed_optimizer", False)),
        [chunk])
    for step in range(2):
        chunk.zero_grad_buffer()
        optimizer.zero_grad()
        gpt_loss(chunk, gpt_batch(step)).backward()
        chunk.finish_grad_sync()
        assert optimizer.step()[0]
    line = memory_usage([chunk], optimizer, torch.device("cpu"))
    reported = line["params_bytes"] + line["grads_bytes"] + line["optimizer_state_bytes"]
    return {"reported": reported, "held": held_storage_bytes(chunk, optimizer), "line": line}


def _all_cases():
    return {(wrapper, bf16): _line_versus_storages(wrapper, bf16) for wrapper in WRAPPERS for bf16 in (False, True)}


@pytest.fixture(scope="module")
def measured():
    return run_on_ranks(2, _all_cases)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_memory_line_equals_held_storage_bytes(measured, wrapper, bf16):
    for rank, cases in enumerate(measured):
        result = cases[(wrapper, bf16)]
        held, reported = result["held"], result["reported"]
        assert abs(reported - held) <= TOLERANCE * held, (rank, wrapper, bf16, result)


def test_fsdp2_bf16_counts_its_fp32_shards_once(measured):
    """FSDP2 under bf16: fp32 shards (params), fp32 gradient shards, two fp32 Adam moments; nothing else."""
    for cases in measured:
        line = cases[("torch_fsdp2", True)]["line"]
        assert line["grads_bytes"] == line["params_bytes"]
        # exp_avg + exp_avg_sq per shard element, plus a 4-byte step per parameter tensor.
        moments = line["optimizer_state_bytes"] - 2 * line["params_bytes"]
        assert 0 <= moments < 4 * 64, line


def _dtensor_main_copies():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from megatron.training.training_log import memory_usage

    mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
    model = torch.nn.Linear(8, 6, bias=False)
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach().bfloat16(), mesh, [Shard(0)]))
    main_copy = torch.nn.Parameter(distribute_tensor(torch.zeros(6, 8), mesh, [Shard(0)]))
    optimizer = types.SimpleNamespace(optimizer=torch.optim.SGD([main_copy], lr=0.1))
    return memory_usage([model], optimizer, torch.device("cpu"))["optimizer_state_bytes"]


def test_dtensor_main_copies_are_counted_as_optimizer_state():
    """Every DTensor's `data_ptr()` is 0: the line tells a main copy from a model parameter by storage."""
    assert run_on_ranks(2, _dtensor_main_copies) == [3 * 8 * 4, 3 * 8 * 4]

"""The memory line's host field: with offloading on, the bytes kept in host memory, against the storages the
run holds and against the bytes per element the offloaded state needs; without offloading no field. On DP2,
fp32, on the CPU (where host and device are one memory, as the line says)."""

import pytest
import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.training.test_memory_line_storages import TOLERANCE, held_storage_bytes

CASES = {
    "megatron_fsdp_param_offload": (dict(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                         data_parallel_sharding_strategy="optim_grads_params",
                                         megatron_fsdp_param_offload=True), dict()),
    "torch_fsdp2_cpu_offload": (dict(use_torch_fsdp2=True, torch_fsdp2_cpu_offload=True), dict()),
    "optimizer_cpu_offload": (dict(use_distributed_optimizer=True),
                              dict(use_distributed_optimizer=True, use_precision_aware_optimizer=True,
                                   optimizer_cpu_offload=True)),
}


def _run(case):
    from megatron.core.distributed import DistributedDataParallelConfig, wrap_data_parallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.training.training_log import _torch_optimizers, format_memory_line, memory_usage
    from tests.unit_tests.distributed.precision_gpt import build_gpt, gpt_batch, gpt_loss

    ddp_fields, optimizer_fields = CASES[case]
    model = build_gpt(untie=ddp_fields.get("use_torch_fsdp2", False))
    chunk = wrap_data_parallel(model.config, DistributedDataParallelConfig(**ddp_fields), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, **optimizer_fields), [chunk])
    for step in range(2):
        chunk.zero_grad_buffer()
        optimizer.zero_grad()
        gpt_loss(chunk, gpt_batch(step)).backward()
        chunk.finish_grad_sync()
        assert optimizer.step()[0]
    line = memory_usage([chunk], optimizer, torch.device("cpu"))
    result = {"line": line, "text": format_memory_line(0, line), "held": held_storage_bytes(chunk, optimizer)}
    offloaded = [entry for opt in _torch_optimizers(optimizer) for entry in getattr(opt, "offloaded", None) or []]
    # The optimizer's steps: one 0-dim tensor per offloaded parameter, outside the per-element bytes.
    result["offloaded_numel"] = sum(entry.host_param.numel() for entry in offloaded)
    result["offloaded_steps"] = sum(
        sum(v.numel() * v.element_size() for v in opt.state.get(entry.device_param, {}).values()
            if torch.is_tensor(v) and v.dim() == 0)
        for opt in _torch_optimizers(optimizer) for entry in getattr(opt, "offloaded", None) or [])
    return result


def _all_cases():
    return {case: _run(case) for case in CASES}


@pytest.fixture(scope="module")
def measured():
    return run_on_ranks(2, _all_cases)


@pytest.mark.parametrize("case", ["megatron_fsdp_param_offload", "torch_fsdp2_cpu_offload"])
def test_sharded_offload_holds_everything_on_the_host(measured, case):
    """ZeRO-3 / FSDP2 with offload keep every persistent tensor in host memory: the host field is the storages
    the run holds (less the padding and model buffers, as in test_memory_line_storages) and the line's total."""
    for rank, cases in enumerate(measured):
        result = cases[case]
        line, held = result["line"], result["held"]
        host = line["host_offload_bytes"]
        assert abs(host - held) <= TOLERANCE * held, (rank, case, host, held)
        assert host == line["params_bytes"] + line["grads_bytes"] + line["optimizer_state_bytes"], (rank, line)


def test_optimizer_offload_counts_host_copies_grads_and_state(measured):
    """Hybrid optimizer, all of it offloaded, fp32: per main-parameter element a host copy, a host gradient
    and two Adam moments (16 bytes), plus each parameter's step."""
    for rank, cases in enumerate(measured):
        result = cases["optimizer_cpu_offload"]
        assert result["offloaded_numel"] > 0
        assert result["line"]["host_offload_bytes"] == 16 * result["offloaded_numel"] + result["offloaded_steps"]
        assert result["line"]["host_offload_bytes"] < result["held"]


def test_no_field_without_offloading():
    from megatron.training.training_log import format_memory_line, memory_usage

    model = torch.nn.Linear(4, 3)
    line = memory_usage([model], torch.optim.Adam(model.parameters()), torch.device("cpu"))
    assert "host_offload_bytes" not in line and "offloaded" not in format_memory_line(0, line)


def test_views_of_one_storage_count_once():
    from megatron.training.host_memory import _distinct_bytes

    flat, other = torch.zeros(10), torch.zeros(3, dtype=torch.float64)
    assert _distinct_bytes([flat[0:4], flat[2:6], flat[8:], other]) == (6 + 2) * 4 + 3 * 8
    assert _distinct_bytes([flat[2:6], flat, other[1:]]) == 10 * 4 + 2 * 8


def test_line_wording(measured):
    from megatron.training.training_log import format_memory_line

    result = measured[0]["megatron_fsdp_param_offload"]
    host = result["line"]["host_offload_bytes"]
    assert result["text"].endswith(f"| offloaded (host memory, on CPU the same memory as the device): {host} bytes |")
    on_gpu = dict(result["line"], on_gpu=True)
    assert format_memory_line(0, on_gpu).endswith(f"| offloaded (host memory): {host} bytes |")

"""--log-energy: NVML's energy counter read per log interval (with a stand-in pynvml module), the log line's
fields, and the message that says why no energy is logged on a CPU or without pynvml."""

import argparse
import sys
import types

import pytest
import torch

from megatron.training import energy_monitor


def _fake_pynvml(millijoule_readings, calls):
    readings = iter(millijoule_readings)
    module = types.ModuleType("pynvml")
    module.nvmlInit = lambda: calls.append("init")
    module.nvmlShutdown = lambda: calls.append("shutdown")
    module.nvmlDeviceGetHandleByIndex = lambda index: calls.append(f"handle {index}") or f"gpu{index}"
    module.nvmlDeviceGetTotalEnergyConsumption = lambda handle: next(readings)
    return module


def test_laps_are_the_energy_used_since_the_previous_one(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([1000, 3500, 9500], calls))
    monitor = energy_monitor.EnergyMonitor(torch.device("cpu"))  # no process group: this rank's energy alone
    assert monitor.lap() == 2.5 and monitor.lap() == 6.0  # joules
    monitor.close()
    assert calls == ["init", "handle 0", "shutdown"]


def test_energy_and_power_per_gpu():
    # 800 J over 2 iterations and 2 GPUs: 200 J per iteration per GPU; at 0.5 s per iteration, 400 W.
    assert energy_monitor.energy_and_power_per_gpu(800.0, 2, 2, 0.5) == (200.0, 400.0)


def test_without_nvml_the_run_says_why_and_logs_no_energy(monkeypatch, capsys):
    args = argparse.Namespace(log_energy=True, device=torch.device("cpu"))
    assert energy_monitor.EnergyMonitor.from_args(args) is None
    assert capsys.readouterr().out == (
        "--log-energy: no energy is logged: the run computes on cpu, and NVML measures NVIDIA GPUs only\n")
    monkeypatch.setattr(energy_monitor.importlib.util, "find_spec", lambda name: None)
    assert energy_monitor.energy_unavailable_reason(torch.device("cuda", 0)) == (
        "pynvml is not installed (pip install nvidia-ml-py)")
    assert energy_monitor.EnergyMonitor.from_args(argparse.Namespace(log_energy=False, device=None)) is None
    assert capsys.readouterr().out == ""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NVML energy counter)")
def test_energy_of_a_real_gpu_grows_with_work():
    pytest.importorskip("pynvml")
    monitor = energy_monitor.EnergyMonitor(torch.device("cuda", 0))
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(50):
        x = x @ x / 64.0
    torch.cuda.synchronize()
    assert monitor.lap() > 0.0
    monitor.close()

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


def test_evaluation_and_checkpoint_saves_are_not_counted(monkeypatch):
    """As upstream pauses its monitor around evaluation and checkpoint saves: a lap holds the training steps'
    energy only, the same span as the log line's iteration time."""
    from megatron.training.global_state import set_energy_monitor

    calls = []
    # Readings (mJ): start 1000; before evaluation 3000; after it 10000; before a save 11000; after it 20000;
    # at the lap 20500. Training used 2 J + 1 J + 0.5 J.
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([1000, 3000, 10000, 11000, 20000, 20500], calls))
    monitor = energy_monitor.EnergyMonitor(torch.device("cpu"))
    set_energy_monitor(monitor)
    try:
        for _ in range(2):  # an evaluation, then a checkpoint save
            with energy_monitor.energy_not_counted(), energy_monitor.energy_not_counted():  # nested: still paused
                pass
        assert monitor.lap() == 3.5
    finally:
        set_energy_monitor(None)
    with energy_monitor.energy_not_counted():  # no monitor (no --log-energy): nothing to pause
        pass

"""`--log-energy`: the energy each rank's GPU consumed, read through NVML (the `pynvml` module of the
nvidia-ml-py package), summed over ranks at every log line.

NVML counts the energy of NVIDIA GPUs only; on another device, or without pynvml, the run says so once when it
starts and logs no energy.
"""

import importlib.util

import torch
import torch.distributed as dist


def energy_unavailable_reason(device):
    """Why NVML cannot measure `device`'s energy here, or None when it can."""
    if device.type != "cuda":
        return f"the run computes on {device.type}, and NVML measures NVIDIA GPUs only"
    if importlib.util.find_spec("pynvml") is None:
        return "pynvml is not installed (pip install nvidia-ml-py)"
    return None


class EnergyMonitor:
    """Energy of this rank's GPU since the last `lap()`, in joules, summed over all ranks by `lap()`."""

    def __init__(self, device):
        import pynvml

        self._nvml = pynvml
        self.device = device
        pynvml.nvmlInit()
        index = device.index if device.index is not None else 0
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self._last_millijoules = self._read_millijoules()

    @classmethod
    def from_args(cls, args):
        """A monitor when --log-energy is set and NVML can measure this device; None (after saying why on rank 0)
        otherwise."""
        if not getattr(args, "log_energy", False):
            return None
        reason = energy_unavailable_reason(args.device)
        if reason is not None:
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"--log-energy: no energy is logged: {reason}", flush=True)
            return None
        return cls(args.device)

    def _read_millijoules(self):
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)

    def lap(self):
        """Joules used by all ranks' GPUs since the previous lap (collective)."""
        now = self._read_millijoules()
        joules = torch.tensor([(now - self._last_millijoules) / 1000.0], dtype=torch.float64, device=self.device)
        self._last_millijoules = now
        if dist.is_initialized():
            dist.all_reduce(joules)
        return float(joules.item())

    def close(self):
        self._nvml.nvmlShutdown()


def energy_and_power_per_gpu(total_joules, iterations, world_size, seconds_per_iteration):
    """(joules per iteration per GPU, mean watts per GPU) of `total_joules` used by all ranks over `iterations`."""
    joules_per_iteration_per_gpu = total_joules / iterations / world_size
    return joules_per_iteration_per_gpu, joules_per_iteration_per_gpu / seconds_per_iteration

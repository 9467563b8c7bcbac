"""`--log-energy`: the energy each rank's GPU consumed, read through NVML (the `pynvml` module of the
nvidia-ml-py package), summed over ranks at every log line.

NVML counts the energy of NVIDIA GPUs only; on another device, or without pynvml, the run says so once when it
starts and logs no energy. As upstream, evaluation and checkpoint saves are not counted (`energy_not_counted`):
the energy per iteration is that of the training steps, over the same time as the log line's iteration time.
"""

import contextlib
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
        self._lap_millijoules = 0  # counted since the previous lap, up to the last reading
        self._paused = False

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

    def _count_until_now(self):
        if not self._paused:
            now = self._read_millijoules()
            self._lap_millijoules += now - self._last_millijoules
            self._last_millijoules = now

    def pause(self):
        """Stop counting (the energy until now stays in the current lap) until `resume()`."""
        self._count_until_now()
        self._paused = True

    def resume(self):
        if self._paused:
            self._last_millijoules = self._read_millijoules()
            self._paused = False

    @contextlib.contextmanager
    def paused(self):
        """Not counting during the block (inside another paused block: still not counting after it)."""
        if self._paused:
            yield
            return
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def lap(self):
        """Joules used by all ranks' GPUs since the previous lap, paused spans left out (collective)."""
        self._count_until_now()
        joules = torch.tensor([self._lap_millijoules / 1000.0], dtype=torch.float64, device=self.device)
        self._lap_millijoules = 0
        if dist.is_initialized():
            dist.all_reduce(joules)
        return float(joules.item())

    def close(self):
        self._nvml.nvmlShutdown()


def energy_not_counted():
    """The running --log-energy monitor paused for the block (evaluation, a checkpoint save); nothing without
    one."""
    from megatron.training.global_state import get_energy_monitor

    try:
        monitor = get_energy_monitor()
    except RuntimeError:  # no --log-energy, or no NVML on this device
        return contextlib.nullcontext()
    return monitor.paused()


def energy_and_power_per_gpu(total_joules, iterations, world_size, seconds_per_iteration):
    """(joules per iteration per GPU, mean watts per GPU) of `total_joules` used by all ranks over `iterations`."""
    joules_per_iteration_per_gpu = total_joules / iterations / world_size
    return joules_per_iteration_per_gpu, joules_per_iteration_per_gpu / seconds_per_iteration

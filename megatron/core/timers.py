"""Named wall-clock timers with log levels, aggregated over ranks (`--timing-log-level`, `--timing-log-option`).

    timers = Timers(log_level=1, log_option="minmax")
    timers("forward-backward", log_level=1).start()
    ...
    timers("forward-backward").stop()
    timers.log(["forward-backward", "optimizer"], normalizer=iterations)   # collective: every rank calls it

A timer whose level is above the configured one is a no-op (`NullTimer`), so call sites need no guard. Each
start/stop waits for the accelerator's queued work (nothing to wait for on the CPU) and may first pass a barrier
so that the time measured is that of the slowest rank. `log` / `write` gather every rank's accumulated time
(milliseconds, divided by `normalizer`), ignore ranks where a timer did not run (zero), and print on the last
rank, or write the maximum to TensorBoard as `<name>-time` in seconds (as upstream, and as `iteration-time`).

Levels as in Megatron: 0 for the one-off and per-interval timers (set-up, checkpoint save/load, the interval
time), 1 for the main parts of a step (forward-backward, gradient all-reduce, parameter all-gather, optimizer),
2 for the fine ones (batch-generator, forward-compute, backward-compute, pipeline send/receive).
"""

import contextlib
from time import perf_counter

import torch
import torch.distributed as dist

LOG_OPTIONS = ("max", "minmax", "all")
MAX_LOG_LEVEL = 2
NAME_WIDTH = 48


def _synchronize_accelerator():
    from megatron.core.device_utils import synchronize

    synchronize()


def _barrier(group):
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


class NullTimer:
    """A timer above the configured log level: every method does nothing."""

    def start(self, barrier=False):
        pass

    def stop(self, barrier=False):
        pass

    def reset(self):
        pass

    def elapsed(self, reset=True, barrier=False):
        raise RuntimeError("elapsed() of a timer above --timing-log-level: it measures nothing")

    def active_time(self):
        return 0.0


class Timer:
    """Accumulates the seconds between `start()` and `stop()` calls until `reset()` (or `elapsed(reset=True)`)."""

    def __init__(self, name, barrier_group=None):
        self.name = name
        self.barrier_group = barrier_group
        self._elapsed_s = 0.0
        self._active_time_s = 0.0
        self._started_at = None

    @property
    def started(self):
        return self._started_at is not None

    def start(self, barrier=False):
        if self.started:
            raise RuntimeError(f"timer {self.name!r} is already running")
        if barrier:
            _barrier(self.barrier_group)
        _synchronize_accelerator()
        self._started_at = perf_counter()

    def stop(self, barrier=False):
        if not self.started:
            raise RuntimeError(f"timer {self.name!r} was stopped without being started")
        if barrier:
            _barrier(self.barrier_group)
        _synchronize_accelerator()
        seconds = perf_counter() - self._started_at
        self._elapsed_s += seconds
        self._active_time_s += seconds
        self._started_at = None

    def reset(self):
        self._elapsed_s = 0.0
        self._started_at = None

    def elapsed(self, reset=True, barrier=False):
        """Seconds accumulated so far (a running timer is counted up to now and keeps running)."""
        running = self.started
        if running:
            self.stop(barrier=barrier)
        seconds = self._elapsed_s
        if reset:
            self.reset()
        if running:
            self.start(barrier=barrier)
        return seconds

    def active_time(self):
        """Seconds accumulated since the timer was created (never reset)."""
        return self._active_time_s


class Timers:
    """The timers of a process; see the module docstring."""

    def __init__(self, log_level, log_option):
        if log_level not in range(MAX_LOG_LEVEL + 1):
            raise ValueError(f"--timing-log-level must be one of 0, 1, 2, got {log_level!r}")
        if log_option not in LOG_OPTIONS:
            raise ValueError(f"--timing-log-option must be one of {', '.join(LOG_OPTIONS)}, got {log_option!r}")
        self._log_level = log_level
        self._log_option = log_option
        self._timers = {}
        self._log_levels = {}
        self._null_timer = NullTimer()

    @property
    def log_level(self):
        return self._log_level

    def __call__(self, name, log_level=None):
        """The timer `name` (created on first use at `log_level`, default 2); a no-op one above the level."""
        if name in self._timers:
            if log_level is not None and log_level != self._log_levels[name]:
                raise ValueError(f"timer {name!r} was created at log level {self._log_levels[name]}, asked again "
                                 f"at {log_level}")
            return self._timers[name]
        log_level = MAX_LOG_LEVEL if log_level is None else log_level
        if log_level not in range(MAX_LOG_LEVEL + 1):
            raise ValueError(f"a timer's log level must be 0, 1 or 2, got {log_level!r}")
        if log_level > self._log_level:
            return self._null_timer
        self._timers[name] = Timer(name)
        self._log_levels[name] = log_level
        return self._timers[name]

    def names(self):
        return list(self._timers)

    # ---- gathering over ranks --------------------------------------------------------------------------------
    def _times_on_all_ranks(self, names, reset, barrier):
        """[world size, len(names)] milliseconds accumulated by each rank (0 where a timer does not exist)."""
        from megatron.core.device_utils import get_current_device

        if barrier:
            _barrier(None)
        local = torch.zeros(len(names), dtype=torch.float64)
        for index, name in enumerate(names):
            if name in self._timers:
                local[index] = self._timers[name].elapsed(reset=reset) * 1000.0
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return local.unsqueeze(0)
        device = get_current_device()
        gathered = [torch.zeros(len(names), dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local.to(device))
        return torch.stack(gathered).cpu()

    def min_max_times(self, names, normalizer=1.0, reset=True, barrier=False):
        """{name: (min ms, max ms)} over the ranks where the timer ran, divided by `normalizer` (collective)."""
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        times = self._times_on_all_ranks(names, reset, barrier)
        result = {}
        for index, name in enumerate(names):
            ran = times[:, index][times[:, index] > 0.0]
            if ran.numel() > 0:
                result[name] = (ran.min().item() / normalizer, ran.max().item() / normalizer)
        return result

    def get_all_timers_string(self, names=None, normalizer=1.0, reset=True, barrier=False):
        """The report of `names` (default: every timer) in the configured log option; None if none ran."""
        names = self.names() if names is None else list(names)
        if self._log_option == "all":
            if normalizer <= 0.0:
                raise ValueError(f"normalizer must be positive, got {normalizer}")
            return _format_all_ranks(names, self._times_on_all_ranks(names, reset, barrier) / normalizer)
        min_max = self.min_max_times(names, normalizer, reset, barrier)
        if not min_max:
            return None
        if self._log_option == "max":
            lines = [f"    {(name + ' ').ljust(NAME_WIDTH, '.')}: {high:.2f}" for name, (_, high) in min_max.items()]
            return "max time across ranks (ms):\n" + "\n".join(lines)
        lines = [f"    {(name + ' ').ljust(NAME_WIDTH, '.')}: ({low:.2f}, {high:.2f})"
                 for name, (low, high) in min_max.items()]
        return "(min, max) time across ranks (ms):\n" + "\n".join(lines)

    def log(self, names, rank=None, normalizer=1.0, reset=True, barrier=False):
        """Print the report of `names` on `rank` (default: the last rank). Collective: every rank calls it."""
        text = self.get_all_timers_string(names, normalizer, reset, barrier)
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        this_rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if text is not None and this_rank == (world_size - 1 if rank is None else rank):
            print(text, flush=True)
        return text

    def write(self, names, writer, iteration, normalizer=1.0, reset=True, barrier=False):
        """Write each timer's maximum over ranks to TensorBoard as `<name>-time`, in seconds as upstream
        (collective; `writer` may be None on ranks that do not write). Returns {name: (min ms, max ms)}."""
        min_max = self.min_max_times(names, normalizer, reset, barrier)
        if writer is not None:
            for name, (_, high_ms) in min_max.items():
                writer.add_scalar(f"{name}-time", high_ms / 1000.0, iteration)
        return min_max


def _format_all_ranks(names, times):
    lines = []
    for index, name in enumerate(names):
        ranks = [(rank, value) for rank, value in enumerate(times[:, index].tolist()) if value > 0.0]
        if ranks:
            lines.append(f"  {name}:")
            lines += [f"     rank {rank:2d}: {value:.2f}" for rank, value in ranks]
    return "times across ranks (ms):\n" + "\n".join(lines) if lines else None


@contextlib.contextmanager
def timed(timers, name, log_level, barrier=False):
    """Time the block with `timers(name, log_level)`; nothing when `timers` is None."""
    if timers is None:
        yield
        return
    timer = timers(name, log_level=log_level)
    timer.start(barrier=barrier)
    try:
        yield
    finally:
        timer.stop()

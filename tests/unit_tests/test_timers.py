"""Timers: elapsed time against a controlled clock, log levels, the max / minmax / all reports over 2 ranks and
TensorBoard values; and the report after the log line of a short `pretrain()` run at --timing-log-level 0, 1, 2."""

import contextlib
import io
import re

import pytest

from megatron.core import timers as timers_module
from megatron.core.timers import NullTimer, Timers, timed
from tests.unit_tests.multiprocess_harness import run_on_ranks


class Clock:
    """A perf_counter that returns the times it is given, in order."""

    def __init__(self, *times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


def test_timer_accumulates_the_clock_between_start_and_stop(monkeypatch):
    monkeypatch.setattr(timers_module, "perf_counter", Clock(10.0, 10.5, 11.0, 11.25, 12.0, 12.5, 12.5, 13.0, 14.0))
    timers = Timers(log_level=1, log_option="minmax")
    step = timers("step", log_level=1)
    step.start()
    step.stop()  # 0.5 s
    with timed(timers, "step", log_level=1):
        pass  # 0.25 s
    assert step.elapsed(reset=False) == 0.75
    step.start()  # at 12.0
    assert step.elapsed(reset=True) == 0.75 + 0.5  # counted up to 12.5, keeps running from 12.5
    assert step.started
    step.stop()  # at 13.0
    assert step.elapsed() == 0.5 and step.active_time() == 0.75 + 0.5 + 0.5
    assert timers_module.perf_counter() == 14.0  # every earlier reading was used, none more


def test_levels_and_bad_input():
    timers = Timers(log_level=1, log_option="max")
    assert isinstance(timers("fine", log_level=2), NullTimer)  # above the level: a no-op, not registered
    timers("fine", log_level=2).start()
    assert timers.names() == []
    assert not isinstance(timers("coarse", log_level=0), NullTimer)
    assert isinstance(timers("default level"), NullTimer)  # default level 2
    with pytest.raises(ValueError, match="created at log level 0, asked again at 1"):
        timers("coarse", log_level=1)
    with pytest.raises(RuntimeError, match="already running"):
        timers("coarse").start()
        timers("coarse").start()
    with pytest.raises(ValueError, match="--timing-log-option must be one of max, minmax, all"):
        Timers(log_level=0, log_option="mean")
    with pytest.raises(ValueError, match="--timing-log-level must be one of 0, 1, 2"):
        Timers(log_level=3, log_option="max")


class RecordingWriter:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, name, value, step):
        self.scalars.append((name, value, step))


def _reports_on_ranks():
    """Rank r spends (r + 1) x 125 ms in `forward-backward` over 2 iterations; only rank 1 runs `optimizer`
    (62.5 ms); `batch-generator` never runs. Reports normalized per iteration (times exact in binary)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    original = timers_module.perf_counter
    reports = {}
    try:
        for option in ("max", "minmax", "all"):
            timers_module.perf_counter = Clock(1.0, 1.0 + 0.125 * (rank + 1), 5.0, 5.0625)
            timers = Timers(log_level=1, log_option=option)
            with timed(timers, "forward-backward", log_level=1):
                pass
            if rank == 1:
                with timed(timers, "optimizer", log_level=1):
                    pass
            timers("batch-generator", log_level=1)
            names = ["forward-backward", "batch-generator", "optimizer"]
            reports[option] = timers.log(names, normalizer=2.0, reset=False)
        writer = RecordingWriter() if rank == 1 else None
        reports["written"] = timers.write(names, writer, iteration=7, normalizer=2.0)
        reports["scalars"] = writer.scalars if writer else None
        reports["after reset"] = timers.get_all_timers_string(names)  # write() reset the timers
    finally:
        timers_module.perf_counter = original
    return reports


@pytest.mark.parametrize("world_size", [2])
def test_max_minmax_all_over_two_ranks(world_size):
    reports = run_on_ranks(world_size, _reports_on_ranks)
    # Every rank computes the same report; only the one given a writer writes.
    assert reports[0]["scalars"] is None
    assert {key: value for key, value in reports[0].items() if key != "scalars"} == {
        key: value for key, value in reports[1].items() if key != "scalars"}
    report = reports[1]
    dots = lambda name: (name + " ").ljust(48, ".")  # noqa: E731
    # Milliseconds per iteration: forward-backward 62.5 on rank 0, 125 on rank 1; optimizer 31.25 on rank 1 only.
    assert report["max"] == (f"max time across ranks (ms):\n    {dots('forward-backward')}: 125.00\n"
                             f"    {dots('optimizer')}: 31.25")
    assert report["minmax"] == (f"(min, max) time across ranks (ms):\n    {dots('forward-backward')}: (62.50, 125.00)\n"
                                f"    {dots('optimizer')}: (31.25, 31.25)")
    assert report["all"] == ("times across ranks (ms):\n  forward-backward:\n     rank  0: 62.50\n"
                             "     rank  1: 125.00\n  optimizer:\n     rank  1: 31.25")
    assert report["written"] == {"forward-backward": (62.5, 125.0), "optimizer": (31.25, 31.25)}
    # TensorBoard gets seconds, as upstream (and as the loop's `iteration-time`).
    assert report["scalars"] == [("forward-backward-time", 0.125, 7), ("optimizer-time", 0.03125, 7)]
    assert report["after reset"] is None


# ---------------------------------------------------------------------------------------------------------
# The report of a short pretrain_gpt.py run
# ---------------------------------------------------------------------------------------------------------

TINY_GPT = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 8 --lr 1e-3 --mock-data --vocab-size 127 --make-vocab-size-divisible-by 64 "
    "--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --eval-iters 0 --ckpt-format torch "
    "--train-iters 2 --log-interval 2 --use-distributed-optimizer"
)
LEVEL_1 = ["forward-backward", "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "all-grads-sync",
           "params-all-gather", "optimizer-copy-to-main-grad", "optimizer-clip-main-grad", "optimizer-inner-step",
           "optimizer-copy-main-to-model-params", "optimizer"]
LEVEL_2 = ["forward-compute", "backward-compute", "batch-generator"]
# The six pipeline transfers of the 1F1B schedule, each run on one of the two stages.
PIPELINE_TRANSFERS = ["forward-recv", "forward-send", "backward-recv", "backward-send", "forward-send-backward-recv",
                      "backward-send-forward-recv"]


def _pretrain_output(level, tensorboard_dir):
    """stdout of a 2-iteration run at timing level `level`: data parallel (distributed optimizer) at levels 0 and
    1, two pipeline stages at level 2 (which times the transfers between stages)."""
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    argv = f"{TINY_GPT} --timing-log-level {level} --tensorboard-dir {tensorboard_dir} --log-timers-to-tensorboard"
    if level == 2:
        argv += " --pipeline-model-parallel-size 2"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                 ModelType.encoder_or_decoder, pretrain_gpt.forward_step, argv=argv.split())
    return stdout.getvalue()


def _timer_report_after_log_line(output):
    """{timer: (min, max)} of the report printed after the `iteration 2/ 2` line (empty when none follows)."""
    lines = output.splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith("iteration 2/ 2 |")) + 1
    if start == len(lines) or lines[start] != "(min, max) time across ranks (ms):":
        return {}
    report = {}
    for line in lines[start + 1:]:
        match = re.fullmatch(r"    (\S+) \.+: \(([0-9.]+), ([0-9.]+)\)", line)
        if match is None:
            break
        report[match.group(1)] = (float(match.group(2)), float(match.group(3)))
    return report


def _tensorboard_scalars(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory))
    accumulator.Reload()
    return {tag: [event.value for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("level", [0, 1, 2])
def test_pretrain_reports_the_timers_of_its_level(tmp_path, world_size, level):
    outputs = run_on_ranks(world_size, _pretrain_output, level, str(tmp_path))
    assert "iteration 2/ 2 |" in outputs[1] and "iteration 2/ 2 |" not in outputs[0]  # printed by the last rank
    report = _timer_report_after_log_line(outputs[1])
    expected = {0: [], 1: LEVEL_1, 2: LEVEL_1 + LEVEL_2 + PIPELINE_TRANSFERS}[level]
    assert sorted(report) == sorted(expected)
    assert all(0.0 < low <= high for low, high in report.values())
    # Each timer nests inside forward-backward except the optimizer and the parameter gather it runs.
    for name in ("all-grads-sync", "forward-compute", "backward-compute", "batch-generator"):
        if name in report:
            assert report[name][1] <= report["forward-backward"][1] * 1.001
    for name in report:  # the step's phases nest inside the optimizer timer
        if name.startswith("optimizer-"):
            assert report[name][1] <= report["optimizer"][1] * 1.001
    # The level-0 set-up timers are reported at every level, once.
    assert outputs[1].count("    model-and-optimizer-setup .") == 1
    scalars = _tensorboard_scalars(tmp_path)
    assert sorted(tag[:-len("-time")] for tag in scalars if tag.endswith("-time") and tag != "iteration-time") == (
        sorted(expected))
    for name in expected:  # iterations 1 and 2: the mean so far over the log interval, then over both iterations
        assert len(scalars[f"{name}-time"]) == 2 and all(value > 0.0 for value in scalars[f"{name}-time"])
        # The printed max (ms, 2 decimals), in seconds.
        assert scalars[f"{name}-time"][1] * 1000.0 == pytest.approx(report[name][1], abs=0.006)

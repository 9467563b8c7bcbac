"""The `iteration-time` TensorBoard scalar, as upstream: written with --log-timers-to-tensorboard only, at each log
line, as the line's mean time per iteration (the metrics file keeps every iteration's own time)."""

import argparse

from megatron.training import training_log
from tests.unit_tests.training.test_training_log import _ScalarRecorder, _report


def _iteration_time_scalars(monkeypatch, tmp_path, log_timers_to_tensorboard):
    recorder = _ScalarRecorder()
    monkeypatch.setattr(training_log, "build_scalar_writers", lambda args: recorder)
    args = argparse.Namespace(metrics_file=None, tensorboard_dir=str(tmp_path), save=None, log_interval=2,
                              train_iters=4, tensorboard_log_interval=1, log_memory_to_tensorboard=False,
                              log_throughput=False, log_timers_to_tensorboard=log_timers_to_tensorboard)
    logger = training_log.TrainingLogger(args, is_logging_rank=True)
    for iteration, seconds in ((1, 0.25), (2, 0.75), (3, 0.5)):
        report = _report(iteration, 1.0)
        report["iteration_time_s"] = seconds
        logger.log_iteration(report)
    logger.close()
    return [(value, step) for name, value, step in recorder.scalars if name == "iteration-time"]


def test_iteration_time_is_the_log_intervals_mean_with_log_timers_to_tensorboard(monkeypatch, tmp_path):
    assert _iteration_time_scalars(monkeypatch, tmp_path, True) == [(0.5, 2)]  # (0.25 + 0.75) / 2, at the log line


def test_no_iteration_time_scalar_without_log_timers_to_tensorboard(monkeypatch, tmp_path):
    assert _iteration_time_scalars(monkeypatch, tmp_path, False) == []

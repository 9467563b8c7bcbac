"""progress.txt's throughput fields: the job's own, and the cumulative one over the latest series of jobs with
this number of ranks (read back from the file)."""

import argparse
import datetime

import pytest

from megatron.training import progress_log


def _line(stamp, gpus, event, flops):
    return (f"{stamp}\tJob ID: \t# GPUs: {gpus}\t{event}\tIteration: 0\tConsumed samples: 0\t"
            f"Tokens (in billions): 0.0\tFloating-point operations: {flops:.6e}\n")


def _epoch(stamp):
    return datetime.datetime.strptime(stamp, progress_log.TIME_FORMAT).timestamp()


def test_series_start_is_the_first_start_among_the_last_lines_of_this_world_size(tmp_path):
    path = tmp_path / "progress.txt"
    path.write_text(
        _line("2026-01-01 00:00:00", 2, "Starting job", 0.0)
        + _line("2026-01-01 01:00:00", 4, "Starting job", 1e15)  # another world size ends the 2-rank series
        + _line("2026-01-01 02:00:00", 2, "Starting job", 2e15)
        + _line("2026-01-01 02:30:00", 2, "Saved checkpoint", 3e15)
        + _line("2026-01-01 03:00:00", 2, "Starting job", 4e15)
    )
    assert progress_log._series_start(str(path), 2) == (_epoch("2026-01-01 02:00:00"), 2e15)
    assert progress_log._series_start(str(path), 4) is None  # the 4-rank job is not among the last lines
    assert progress_log._series_start(str(tmp_path / "missing.txt"), 2) is None


def test_cumulative_throughput_counts_from_the_series_start(tmp_path, monkeypatch):
    # A model large enough that the throughputs (printed with 6 decimals) carry 8 significant digits.
    args = argparse.Namespace(save=str(tmp_path), world_size=2, seq_length=4096, consumed_train_samples=80,
                              hidden_size=8192, num_layers=32, kv_channels=128, num_attention_heads=64,
                              swiglu=False, ffn_hidden_size=32768, padded_vocab_size=65536)
    flops_per_sample = progress_log.floating_point_operations(args, 1)
    (tmp_path / "progress.txt").write_text(_line("2026-01-01 02:00:00", 2, "Starting job", 20 * flops_per_sample))
    now = _epoch("2026-01-01 02:00:00") + 100.0
    monkeypatch.setattr(progress_log.time, "time", lambda: now)
    monkeypatch.setattr(progress_log, "_JOB_START", (now - 10.0, 60))  # this job started at sample 60
    fields = dict(field.split(": ", 1) for field in progress_log._progress_fields(args, 10))
    job = 20 * flops_per_sample / 10.0 / 2 / 1e12
    cumulative = 60 * flops_per_sample / 100.0 / 2 / 1e12
    assert float(fields["Job throughput"].split()[0]) == pytest.approx(job, rel=1e-7)
    assert float(fields["Cumulative throughput"].split()[0]) == pytest.approx(cumulative, rel=1e-7)
    assert fields["Cumulative throughput"].endswith(" TFLOP/s/GPU")

"""`examples/fp8/benchmark_fp8.py --part gpu --smoke`: the GPU benchmark's code paths on the CPU with tiny shapes
(per-linear timings of every arm, the report tables, the metrics-file parsing), every end-to-end arm's flags, and one
end-to-end arm launched (the whole `--smoke` run launches six: `python examples/fp8/benchmark_fp8.py --part gpu
--smoke`)."""

import json
import os
import subprocess

import pytest

from examples.fp8 import gpu_benchmark
from tests.unit_tests.examples import forked_launches


def test_linear_part_and_report_run_on_the_cpu(capsys):
    result = gpu_benchmark.run(smoke=True, skip_pretrain=True)
    arms = {"bf16 F.linear", "fp8_linear tensorwise", "fp8_linear delayed", "fp8_linear tensorwise, weight cached",
            "fp8_linear tensorwise, no Triton kernels"}
    assert set(result["linear_ms"]) == {"64x32x48", "64x48x32"}
    for timings in result["linear_ms"].values():
        assert arms <= set(timings) and all(value > 0 for value in timings.values())
    printed = capsys.readouterr().out
    assert "| 64x32x48 |" in printed and "fp8 tensorwise / bf16" in printed


def test_median_step_reads_iterations_4_to_10(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"iteration": i, "iteration-time": 100.0 if i < 4 else float(i)} for i in range(1, 11)]
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert gpu_benchmark._median_step(str(metrics)) == 7.0  # median of 4..10, the slow first steps left out
    assert "nccl" in gpu_benchmark.GPT_1_3B and "--num-layers 24" in gpu_benchmark.GPT_1_3B


def _forked_torchrun(server, log, run):
    """`subprocess.run` for the benchmark: its torchrun launch of pretrain_gpt.py runs with the rank forked from
    the launch server (forked_launches.py); anything else runs as given."""
    def run_command(command, *args, cwd=None, timeout=None, **kwargs):
        try:
            forked_launches.torchrun_ranks(command)
        except ValueError:
            return run(command, *args, cwd=cwd, timeout=timeout, **kwargs)
        return forked_launches.run_forked(server, command, cwd, log, timeout)
    return run_command


def test_every_pretrain_arm_validates_and_one_runs_on_the_cpu(tmp_path, monkeypatch, launch_server):
    """Each of the six arms' command lines (the GPT-1.3B model) passes argument validation; one arm, the most
    involved (Megatron-FSDP z3 with delayed FP8), runs end to end on the smoke model and reports its median step.
    The run's rank is forked from the launch server instead of started by torchrun (the torchrun command line
    itself: test_pretrain_arm_asks_torchrun_for_a_free_port)."""
    from megatron.training.arguments import parse_args, validate_args

    for wrapper_args in gpu_benchmark.WRAPPERS.values():
        for precision_args in gpu_benchmark.PRECISIONS.values():
            argv = f"{gpu_benchmark.GPT_1_3B} {wrapper_args} {precision_args} --train-iters 10".split()
            validate_args(parse_args(args=argv))
    extra = f"{gpu_benchmark.WRAPPERS['Megatron-FSDP z3']} {gpu_benchmark.PRECISIONS['fp8 delayed']}"
    monkeypatch.setattr(gpu_benchmark.subprocess, "run",
                        _forked_torchrun(launch_server, tmp_path / "rank.log", subprocess.run))
    median_step_s = gpu_benchmark.run_pretrain(gpu_benchmark.SMOKE_GPT, extra, str(tmp_path),
                                               gpu_benchmark.MEDIAN_FROM_ITERATION + 1)
    assert 0 < median_step_s < 60


def test_pretrain_arm_asks_torchrun_for_a_free_port(tmp_path, monkeypatch):
    """A run launched beside another job on this host (another test session, another benchmark) asks torchrun for a
    free rendezvous port instead of a fixed one that the other job may already be listening on."""
    launched = []

    def record(command, **kwargs):
        launched.append(command)
        return subprocess.CompletedProcess(command, 1, "", "stopped before launching")

    monkeypatch.setattr(gpu_benchmark.subprocess, "run", record)
    with pytest.raises(RuntimeError, match="stopped before launching"):
        gpu_benchmark.run_pretrain(gpu_benchmark.SMOKE_GPT, "", str(tmp_path), 2)
    torchrun_args = launched[0][:launched[0].index(os.path.join(gpu_benchmark.REPO_ROOT, "pretrain_gpt.py"))]
    assert "--standalone" in torchrun_args and not any(arg.startswith("--master-port") for arg in torchrun_args)


def test_diagnostics_run_on_the_cpu():
    """`--part gpu-diagnostics --smoke`: every table of the diagnostics is filled (GEMMs alone, quantizing passes,
    host against device time for bf16 and both FP8 paths, the profiler's table)."""
    from examples.fp8 import gpu_diagnostics

    table = gpu_diagnostics.run(smoke=True)["table"]
    for row in ("| forward x @ w.T |", "| all three |", "| output gradient (+ transpose) |", "| bf16 F.linear |",
                "| fp8_linear tensorwise |", "| fp8_linear tensorwise, no Triton kernels |", "Fp8LinearFunction"):
        assert row in table, row

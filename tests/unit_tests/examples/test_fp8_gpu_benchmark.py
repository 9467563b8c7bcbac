"""`examples/fp8/benchmark_fp8.py --part gpu --smoke`: the GPU benchmark's code paths on the CPU with tiny shapes
(per-linear timings of every arm, the report tables, the metrics-file parsing); the whole smoke run with its six
`pretrain_gpt.py` launches is the slow test."""

import json
import os
import subprocess
import sys

import pytest

from examples.fp8 import gpu_benchmark


def test_linear_part_and_report_run_on_the_cpu(capsys):
    result = gpu_benchmark.run(smoke=True, skip_pretrain=True)
    arms = {"bf16 F.linear", "fp8_linear tensorwise", "fp8_linear delayed"}
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


@pytest.mark.slow  # six pretrain_gpt.py launches: about three minutes on two cores
def test_whole_smoke_run(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    output = tmp_path / "report.json"
    subprocess.run([sys.executable, "examples/fp8/benchmark_fp8.py", "--part", "gpu", "--smoke", "--output",
                    str(output)], cwd=root, check=True, timeout=900)
    report = json.loads(output.read_text())["gpu"]
    assert set(report["pretrain_step_s"]) == {"Megatron DDP", "Megatron-FSDP z3"}
    for steps in report["pretrain_step_s"].values():
        assert set(steps) == {"bf16", "fp8 tensorwise", "fp8 delayed"} and all(v > 0 for v in steps.values())

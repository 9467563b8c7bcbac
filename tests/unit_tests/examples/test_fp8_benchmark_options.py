"""`examples/fp8/benchmark_fp8.py`'s option checks: part 1 reports the median step time after its warm-up
iterations, so an `--iters` that leaves none is refused before any arm is launched."""

import pytest

from examples.fp8 import benchmark_fp8


def test_iters_must_leave_iterations_after_the_warm_up(capsys):
    with pytest.raises(SystemExit) as stopped:
        benchmark_fp8.parse_options(["--iters", str(benchmark_fp8.WARMUP_ITERATIONS)])
    assert stopped.value.code == 2
    message = capsys.readouterr().err
    assert f"--iters {benchmark_fp8.WARMUP_ITERATIONS}:" in message
    assert f"give --iters {benchmark_fp8.WARMUP_ITERATIONS + 1} or more" in message


def test_iters_after_the_warm_up_and_the_gpu_part_are_accepted():
    first_accepted = benchmark_fp8.WARMUP_ITERATIONS + 1
    assert benchmark_fp8.parse_options(["--iters", str(first_accepted)]).iters == first_accepted
    # Part 3 does not read --iters.
    assert benchmark_fp8.parse_options(["--iters", "1", "--part", "gpu", "--smoke"]).part == "gpu"


def _fake_arm(name, iters, nproc, workdir):
    return {"median_step_s": 0.01 * (1 + len(name) % 3), "gathered_bytes_per_step": 1000 + len(name),
            "fp8_bytes_per_step": 0, "final_loss": 5.0}


@pytest.mark.parametrize("skip_gemm", [False, True])
def test_part_one_is_printed_before_part_two_and_skip_gemm_leaves_part_two_out(monkeypatch, capsys, skip_gemm):
    timed_shapes = []

    def fake_time_linear(tokens, features, repeats):
        if not timed_shapes:  # part 1's table is out before any GEMM is timed
            assert "| fp32 |" in capsys.readouterr().out
        timed_shapes.append((tokens, features))
        return {"fp32 F.linear": 1e-3, "fp8 torch._scaled_mm": 2e-3, "fp8 emulated": 3e-3}

    monkeypatch.setattr(benchmark_fp8, "run_arm", _fake_arm)
    monkeypatch.setattr(benchmark_fp8, "time_linear", fake_time_linear)
    options = benchmark_fp8.parse_options(["--iters", "5", "--repeats", "1"] + (["--skip-gemm"] if skip_gemm else []))
    report = benchmark_fp8.run_cpu_parts(options)
    assert set(report["arms"]) == set(benchmark_fp8.ARMS)
    if skip_gemm:
        assert timed_shapes == [] and "gemm_forward_backward_s" not in report
        assert "| fp32 |" in capsys.readouterr().out
    else:
        assert timed_shapes == [(2048, 128), (4096, 1024)]
        assert set(report["gemm_forward_backward_s"]) == {"2048x128", "4096x1024"}

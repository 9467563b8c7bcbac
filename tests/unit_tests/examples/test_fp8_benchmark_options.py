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

"""examples/packed_sequences/benchmark_attention.py: one row per sequence count, both paths giving the same values
(so the timings compare the same computation), and the flags it refuses."""

import pytest

from tests.unit_tests.multiprocess_harness import run_on_ranks


def _small_table():
    from examples.packed_sequences.benchmark_attention import main
    from megatron.core import parallel_state

    try:
        return main(["--row", "64", "--sequences", "4", "8", "--repeats", "1"])
    finally:
        parallel_state.destroy_model_parallel()


def test_each_sequence_count_gets_a_row_with_equal_results():
    lines = run_on_ranks(1, _small_table)[0].splitlines()
    assert len(lines) == 4 and lines[2].startswith("| 4 of 16 |") and lines[3].startswith("| 8 of 8 |")
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert float(cells[3]) < 1e-5 and float(cells[6]) < 1e-5  # output and loss differences of the two paths
        assert cells[2].endswith(" x") and cells[5].endswith(" x")


def test_a_count_that_does_not_divide_the_row_is_refused():
    from examples.packed_sequences.benchmark_attention import main

    with pytest.raises(SystemExit):
        main(["--row", "64", "--sequences", "5"])

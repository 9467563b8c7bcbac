"""examples/sft/benchmark_packing.py: both layouts of the same conversations train the same tokens (the same summed
loss), the packed one in fewer samples with less padding, and the flags it refuses."""

import pytest

from tests.unit_tests.multiprocess_harness import run_on_ranks


def _small_table():
    from examples.sft.benchmark_packing import main
    from megatron.core import parallel_state

    try:
        return main(["--conversations", "12", "--seq-length", "1024", "--repeats", "1"])
    finally:
        parallel_state.destroy_model_parallel()


def test_both_layouts_train_the_same_tokens_to_the_same_summed_loss():
    lines = run_on_ranks(1, _small_table)[0].splitlines()
    assert len(lines) == 4 and lines[2].startswith("| packed |") and lines[3].startswith("| padded |")
    packed, padded = ([cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:])
    assert int(padded[1]) == 12 and int(packed[1]) < 12  # one sample per conversation, fewer packed rows
    assert packed[3] == padded[3]  # the same trained tokens
    assert int(packed[4].rstrip("%")) < int(padded[4].rstrip("%"))
    assert abs(float(packed[7]) - float(padded[7])) <= 1e-6 * abs(float(padded[7]))


def test_bad_sizes_are_refused():
    from examples.sft.benchmark_packing import main

    with pytest.raises(SystemExit):
        main(["--conversations", "0"])

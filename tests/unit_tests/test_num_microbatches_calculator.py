"""The global batch splits into equal microbatches per data-parallel rank, or the flags are rejected."""

import pytest

from megatron.core import num_microbatches_calculator as calculator


@pytest.fixture(autouse=True)
def fresh_calculator():
    calculator.destroy_num_microbatches_calculator()
    yield
    calculator.destroy_num_microbatches_calculator()


def test_num_microbatches_from_batch_sizes():
    calculator.init_num_microbatches_calculator(0, global_batch_size=32, micro_batch_size=2, data_parallel_size=4)
    assert calculator.get_num_microbatches() == 4
    assert calculator.get_current_global_batch_size() == 32
    assert calculator.get_micro_batch_size() == 2
    calculator.update_num_microbatches(consumed_samples=320)
    assert calculator.get_num_microbatches() == 4


@pytest.mark.parametrize("global_batch_size, micro_batch_size, data_parallel_size", [(30, 4, 2), (12, 5, 1), (8, 1, 3)])
def test_indivisible_global_batch_names_the_flags(global_batch_size, micro_batch_size, data_parallel_size):
    with pytest.raises(ValueError) as error:
        calculator.init_num_microbatches_calculator(0, global_batch_size, micro_batch_size, data_parallel_size)
    message = str(error.value)
    assert "--global-batch-size" in message and "--micro-batch-size" in message and "data-parallel size" in message
    assert str(micro_batch_size * data_parallel_size) in message
    assert not calculator.num_microbatches_calculator_is_initialized()


@pytest.mark.parametrize("bad_value", [0, -2, 2.0])
def test_non_positive_sizes_are_rejected(bad_value):
    with pytest.raises(ValueError, match="--micro-batch-size must be a positive integer"):
        calculator.init_num_microbatches_calculator(0, 8, bad_value, 1)


def test_use_before_init_and_double_init_are_errors():
    with pytest.raises(RuntimeError, match="init_num_microbatches_calculator"):
        calculator.get_num_microbatches()
    calculator.init_num_microbatches_calculator(1, 8, 1, 2)
    assert calculator.get_num_microbatches() == 4
    with pytest.raises(RuntimeError, match="destroy_num_microbatches_calculator"):
        calculator.init_num_microbatches_calculator(1, 8, 1, 2)
    calculator.destroy_num_microbatches_calculator()
    calculator.init_num_microbatches_calculator(1, 16, 1, 2)
    assert calculator.get_num_microbatches() == 8

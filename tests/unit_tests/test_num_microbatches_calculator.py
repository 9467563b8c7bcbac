"""The global batch splits into equal microbatches per data-parallel rank, or the flags are rejected."""

import pytest

from megatron.core import num_microbatches_calculator as calculator


@pytest.fixture(autouse=True)
def fresh_calculator():
    calculator.destroy_num_microbatches_calculator()
    yield
    calculator.destroy_num_microbatches_calculator()


def test_num_microbatches_from_batch_sizes():
    calculator.init_num_microbatches_calculator(0, None, global_batch_size=32, micro_batch_size=2,
                                                data_parallel_size=4)
    assert calculator.get_num_microbatches() == 4
    assert calculator.get_current_global_batch_size() == 32
    assert calculator.get_micro_batch_size() == 2
    calculator.update_num_microbatches(consumed_samples=320)
    assert calculator.get_num_microbatches() == 4


@pytest.mark.parametrize("global_batch_size, micro_batch_size, data_parallel_size",
                         [(30, 4, 2), (12, 5, 1), (8, 1, 3)])
def test_indivisible_global_batch_names_the_flags(global_batch_size, micro_batch_size, data_parallel_size):
    with pytest.raises(ValueError) as error:
        calculator.init_num_microbatches_calculator(0, None, global_batch_size, micro_batch_size, data_parallel_size)
    message = str(error.value)
    assert "--global-batch-size" in message and "--micro-batch-size" in message and "data-parallel size" in message
    assert str(micro_batch_size * data_parallel_size) in message
    assert not calculator.num_microbatches_calculator_is_initialized()


@pytest.mark.parametrize("bad_value", [0, -2, 2.0])
def test_non_positive_sizes_are_rejected(bad_value):
    with pytest.raises(ValueError, match="--micro-batch-size must be a positive integer"):
        calculator.init_num_microbatches_calculator(0, None, 8, bad_value, 1)


def test_use_before_init_and_double_init_are_errors():
    with pytest.raises(RuntimeError, match="init_num_microbatches_calculator"):
        calculator.get_num_microbatches()
    calculator.init_num_microbatches_calculator(1, None, 8, 1, 2)
    assert calculator.get_num_microbatches() == 4
    with pytest.raises(RuntimeError, match="destroy_num_microbatches_calculator"):
        calculator.init_num_microbatches_calculator(1, None, 8, 1, 2)
    calculator.destroy_num_microbatches_calculator()
    calculator.init_num_microbatches_calculator(1, None, 16, 1, 2)
    assert calculator.get_num_microbatches() == 8


def test_upstream_positional_order_rampup_strings_and_verbose_update(caplog):
    # Megatron-Core's order: rank, rampup_batch_size, global, micro, data-parallel; the ramp as argparse's strings.
    calculator.init_num_microbatches_calculator(0, ["4", "4", "16"], 12, 2, 2)
    assert (calculator.get_current_global_batch_size(), calculator.get_num_microbatches()) == (4, 1)
    with caplog.at_level("INFO", logger=calculator.__name__):
        calculator.update_num_microbatches(8, consistency_check=True, verbose=True)
    assert (calculator.get_current_global_batch_size(), calculator.get_current_running_global_batch_size(),
            calculator.get_num_microbatches()) == (8, 8, 2)
    assert "after 8 consumed samples the global batch size is 8" in caplog.text
    calculator.update_num_microbatches(17)
    assert calculator.get_num_microbatches() == 3
    with pytest.raises(ValueError, match="--rampup-batch-size \\['4', 'x', '16'\\]: the start, increment"):
        calculator.reconfigure_num_microbatches_calculator(0, ["4", "x", "16"], 12, 2, 2)


def test_reconfigure_replaces_and_unset_forgets_the_calculator():
    calculator.init_num_microbatches_calculator(0, None, 8, 1, 2)
    calculator.reconfigure_num_microbatches_calculator(0, None, 30, 4, 2, decrease_batch_size_if_needed=True)
    assert (calculator.get_current_global_batch_size(), calculator.get_current_running_global_batch_size(),
            calculator.get_num_microbatches(), calculator.get_micro_batch_size()) == (30, 24, 3, 4)
    calculator.unset_num_microbatches_calculator()
    assert not calculator.num_microbatches_calculator_is_initialized()

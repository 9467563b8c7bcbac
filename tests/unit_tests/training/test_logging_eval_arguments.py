"""Logging flags as upstream's launch scripts spell them."""

from tests.unit_tests.training.argument_checks import validated


def test_upstreams_misspelt_learning_rate_switch_turns_the_scalar_off():
    assert validated().log_learning_rate_to_tensorboard is True
    assert validated("--no-log-learnig-rate-to-tensorboard").log_learning_rate_to_tensorboard is False
    assert validated("--no-log-learning-rate-to-tensorboard").log_learning_rate_to_tensorboard is False

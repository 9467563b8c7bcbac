"""--exit-signal-handler installs the handler for --exit-signal; without it, as upstream, the signal keeps its
action and the loop makes no collective for it."""

import signal

import pytest

from megatron.training.arguments import parse_args
from megatron.training.signal_handler import exit_signal_handler_from_args
from tests.unit_tests.training.argument_checks import BASE, validated


def _parsed(extra):
    return parse_args(args=f"{BASE} {extra}".split())


def test_without_the_flag_the_signal_keeps_its_action():
    before = signal.getsignal(signal.SIGUSR1)
    with exit_signal_handler_from_args(_parsed("--exit-signal SIGUSR1")) as handler:
        assert signal.getsignal(signal.SIGUSR1) is before
        assert handler.received_on_any_rank("cpu") is False


def test_with_the_flag_the_signal_is_recorded_and_the_handler_restored():
    before = signal.getsignal(signal.SIGUSR1)
    with exit_signal_handler_from_args(_parsed("--exit-signal-handler --exit-signal SIGUSR1")) as handler:
        assert signal.getsignal(signal.SIGUSR1) is not before
        assert handler.received_on_any_rank("cpu") is False
        signal.raise_signal(signal.SIGUSR1)
        assert handler.received_on_any_rank("cpu") is True
    assert signal.getsignal(signal.SIGUSR1) is before


def test_another_exit_signal_without_the_handler_is_named_in_a_warning():
    with pytest.warns(UserWarning, match="--exit-signal SIGUSR2 takes effect with --exit-signal-handler"):
        validated("--exit-signal SIGUSR2")

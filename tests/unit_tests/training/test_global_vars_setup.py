"""Upstream's `set_global_variables()` / `unset_global_variables()` (and `destroy_global_vars()`) for scripts that
set up the process-wide handles themselves, and `get_energy_monitor()`, the --log-energy monitor of the training
log."""

import argparse
import signal

import pytest

from megatron.core import num_microbatches_calculator
from megatron.core.timers import Timers
from megatron.training import global_vars, training_log
from tests.unit_tests.training.argument_checks import validated


@pytest.mark.parametrize("unset", ["unset_global_variables", "destroy_global_vars"])
def test_set_global_variables_sets_up_what_scripts_read_and_unset_forgets_it(unset):
    args = validated("--global-batch-size 8 --exit-signal-handler --exit-signal SIGUSR1")
    before = signal.getsignal(signal.SIGUSR1)
    namespace = {}
    exec(f"from megatron.training.global_vars import set_global_variables, {unset} as unset", namespace)
    namespace["set_global_variables"](args)
    try:
        assert global_vars.get_args() is args
        assert global_vars.get_tokenizer().vocab_size == 129 and args.padded_vocab_size == 256  # 128 + EOD, padded
        assert num_microbatches_calculator.get_num_microbatches() == 4  # 8 / (micro batch 2 x 1 data-parallel rank)
        assert isinstance(global_vars.get_timers(), Timers)
        handler = global_vars.get_signal_handler()
        signal.raise_signal(signal.SIGUSR1)  # recorded, not acted on
        assert handler.signals_received() == [True]
    finally:
        namespace["unset"]()
    assert signal.getsignal(signal.SIGUSR1) is before
    for getter in (global_vars.get_args, global_vars.get_tokenizer, global_vars.get_signal_handler,
                   num_microbatches_calculator.get_num_microbatches):
        with pytest.raises(RuntimeError):
            getter()
    with pytest.raises(RuntimeError, match="timers is not initialized"):
        global_vars.get_timers()


def test_getters_outside_set_up_name_what_to_call_or_return_none_as_upstream():
    """As upstream, get_timers() before set-up is an error (not None, which `get_timers()("x")` would turn into
    "'NoneType' object is not callable"); the writers and the one-logger are None until training has them."""
    global_vars.unset_global_variables()
    for getter, message in ((global_vars.get_timers, "timers is not initialized: call initialize_megatron() or "
                             "megatron.training.global_vars.set_global_variables(args) first"),
                            (global_vars.get_tokenizer, "the tokenizer is not built: call "
                             "megatron.training.global_vars.set_global_variables(args)")):
        with pytest.raises(RuntimeError) as raised:
            getter()
        assert str(raised.value).startswith(message)
    for getter in (global_vars.get_tensorboard_writer, global_vars.get_wandb_writer, global_vars.get_one_logger,
                   global_vars.get_adlr_autoresume):
        assert getter() is None, getter.__name__


def test_set_global_variables_without_the_tokenizer():
    args = validated("--global-batch-size 8")
    global_vars.set_global_variables(args, build_tokenizer=False)
    try:
        with pytest.raises(RuntimeError, match="the tokenizer is not built"):
            global_vars.get_tokenizer()
        assert num_microbatches_calculator.get_num_microbatches() == 4
        with pytest.raises(RuntimeError, match="--exit-signal-handler"):  # no flag, no handler
            global_vars.get_signal_handler()
    finally:
        global_vars.unset_global_variables()


def test_energy_monitor_is_the_training_logs_while_it_runs(monkeypatch):
    class FakeMonitor:
        def lap(self):
            return 3.0

        def close(self):
            pass

    monitor = FakeMonitor()
    monkeypatch.setattr(training_log.EnergyMonitor, "from_args", classmethod(lambda cls, args: monitor))
    args = argparse.Namespace(metrics_file=None, tensorboard_dir=None, save=None, log_energy=True)
    with pytest.raises(RuntimeError, match="get_energy_monitor\\(\\): no energy monitor: it exists with --log-energy"):
        global_vars.get_energy_monitor()
    logger = training_log.TrainingLogger(args, is_logging_rank=False)
    assert global_vars.get_energy_monitor() is monitor
    logger.close()
    with pytest.raises(RuntimeError, match="--log-energy"):
        global_vars.get_energy_monitor()

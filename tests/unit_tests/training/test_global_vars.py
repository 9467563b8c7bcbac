"""Upstream's `megatron.training.global_vars` names: scripts import the writers, the signal handler and the other
handles from there (as well as from `megatron.training`), and get the objects the training loop uses."""

import argparse
import signal
import sys
import types

import pytest

import megatron.training
from megatron.training import global_vars, training_log
from megatron.training.signal_handler import exit_signal_handler_from_args

UPSTREAM_GLOBAL_VARS_NAMES = ("get_args", "get_tokenizer", "get_timers", "get_tensorboard_writer",
                              "get_wandb_writer", "get_signal_handler", "get_one_logger", "get_adlr_autoresume")


def test_upstream_names_import_from_global_vars_and_are_the_packages():
    namespace = {}
    exec(f"from megatron.training.global_vars import {', '.join(UPSTREAM_GLOBAL_VARS_NAMES)}", namespace)
    for name in UPSTREAM_GLOBAL_VARS_NAMES:
        assert namespace[name] is getattr(megatron.training, name), name
    assert namespace["get_one_logger"]() is None and namespace["get_adlr_autoresume"]() is None


def _logger_args(tmp_path, **flags):
    args = argparse.Namespace(metrics_file=None, tensorboard_dir=None, save=None, log_interval=1, train_iters=2,
                              tensorboard_log_interval=1, log_memory_to_tensorboard=False, log_throughput=False,
                              tensorboard_queue_size=1000)
    vars(args).update(flags)
    return args


def test_scripts_write_to_the_training_logs_tensorboard_writer(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    tensorboard_dir = tmp_path / "tb"
    assert global_vars.get_tensorboard_writer() is None  # before training: none
    logger = training_log.TrainingLogger(_logger_args(tmp_path, tensorboard_dir=str(tensorboard_dir)),
                                         is_logging_rank=True)
    writer = global_vars.get_tensorboard_writer()
    assert isinstance(writer, SummaryWriter) and writer.log_dir == str(tensorboard_dir)
    writer.add_scalar("my-metric", 0.25, 3)  # what upstream scripts do with it
    logger.close()
    assert global_vars.get_tensorboard_writer() is None  # closed with the log: no writes to a closed writer

    events = EventAccumulator(str(tensorboard_dir))
    events.Reload()
    assert [(event.step, event.value) for event in events.Scalars("my-metric")] == [(3, 0.25)]


def test_no_tensorboard_writer_on_ranks_that_do_not_log(tmp_path):
    logger = training_log.TrainingLogger(_logger_args(tmp_path, tensorboard_dir=str(tmp_path / "tb")),
                                         is_logging_rank=False)
    assert global_vars.get_tensorboard_writer() is None
    logger.close()


def test_scripts_log_to_the_training_logs_wandb_run(tmp_path, monkeypatch):
    logged = []
    run = types.SimpleNamespace(log=lambda data, step=None: logged.append((data, step)), finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kwargs: run))
    args = _logger_args(tmp_path, wandb_project="p", wandb_exp_name="e", wandb_save_dir=str(tmp_path / "wandb"),
                        wandb_entity="")
    logger = training_log.TrainingLogger(args, is_logging_rank=True)
    assert global_vars.get_tensorboard_writer() is None  # no --tensorboard-dir
    assert global_vars.get_wandb_writer() is run
    global_vars.get_wandb_writer().log({"my-metric": 2.0}, 7)  # upstream scripts' call
    logger.close()
    assert logged == [({"my-metric": 2.0}, 7)]
    assert global_vars.get_wandb_writer() is None


def test_signal_handler_is_available_while_the_loop_holds_it():
    exit_on_signal = argparse.Namespace(exit_signal_handler=True, exit_signal="SIGUSR1")
    with pytest.raises(RuntimeError, match="it exists with --exit-signal-handler, from initialize_megatron"):
        global_vars.get_signal_handler()
    with exit_signal_handler_from_args(exit_on_signal) as handler:
        assert global_vars.get_signal_handler() is handler
        assert handler.signals_received() == [False]
        signal.raise_signal(signal.SIGUSR1)
        assert handler.signals_received() == [True]
    with pytest.raises(RuntimeError, match="--exit-signal-handler"):
        global_vars.get_signal_handler()
    with exit_signal_handler_from_args(argparse.Namespace(exit_signal_handler=False, exit_signal="SIGUSR1")):
        with pytest.raises(RuntimeError, match="--exit-signal-handler"):
            global_vars.get_signal_handler()

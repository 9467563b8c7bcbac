"""Upstream's `megatron.training.global_vars`: the process-wide handles (`get_args()`, `get_tokenizer()`,
`get_timers()`, `get_tensorboard_writer()`, ...; held in `global_state.py`) and `set_global_variables()` /
`unset_global_variables()` for scripts that set them up themselves."""

from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
from megatron.core.timers import Timers
from megatron.training.global_state import (  # upstream's names, re-exported
    set_args,
    get_args,
    set_tokenizer,
    get_tokenizer,
    set_timers,
    get_timers,
    set_scalar_writers,
    get_tensorboard_writer,
    get_wandb_writer,
    set_signal_handler,
    installed_signal_handler,
    get_signal_handler,
    set_energy_monitor,
    get_energy_monitor,
    get_one_logger,
    get_adlr_autoresume,
)
from megatron.training.signal_handler import install_exit_signal_handler, uninstall_exit_signal_handler
from megatron.training.initialize import set_up_microbatches, set_up_tokenizer

__all__ = [
    "set_args",
    "get_args",
    "set_tokenizer",
    "get_tokenizer",
    "set_timers",
    "get_timers",
    "set_scalar_writers",
    "get_tensorboard_writer",
    "get_wandb_writer",
    "set_signal_handler",
    "installed_signal_handler",
    "get_signal_handler",
    "set_energy_monitor",
    "get_energy_monitor",
    "get_one_logger",
    "get_adlr_autoresume",
    "set_global_variables",
    "unset_global_variables",
    "destroy_global_vars",
    "unset_global_state",
]


def set_global_variables(args, build_tokenizer=True):
    """Upstream's set-up of the process-wide handles for a script that does not call `initialize_megatron()`:
    the arguments (validated), the number-of-microbatches calculator, the tokenizer (which pads
    `args.padded_vocab_size`; not with `build_tokenizer=False`), the timers and, with --exit-signal-handler, the
    signal handler. The TensorBoard / W&B writers and the energy monitor come with the training log, when
    `pretrain()` trains. Undo with `unset_global_variables()`."""
    set_args(args)
    set_up_microbatches(args)
    if build_tokenizer:
        set_up_tokenizer(args)
    set_timers(Timers(args.timing_log_level, args.timing_log_option))
    install_exit_signal_handler(args)


def unset_global_variables():
    """Forget every handle `set_global_variables()`, `initialize_megatron()` or `pretrain()` set: the arguments,
    tokenizer, timers, writers, energy monitor and number-of-microbatches calculator, and give --exit-signal its
    previous action back (upstream's name; for scripts and tests that set up more than once per process)."""
    uninstall_exit_signal_handler()
    set_args(None)
    set_tokenizer(None)
    set_timers(None)
    set_scalar_writers(None, None)
    set_energy_monitor(None)
    destroy_num_microbatches_calculator()


destroy_global_vars = unset_global_variables  # upstream's other name for it
unset_global_state = unset_global_variables

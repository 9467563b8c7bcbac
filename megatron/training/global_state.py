"""Process-wide handles: the parsed arguments, the tokenizer and the timers (set by `initialize_megatron()`, which
`pretrain()` calls), the --exit-signal-handler handler (from start-up on), and while
`pretrain()` trains, the training log's TensorBoard writer, W&B run and --log-energy monitor. Scripts import them
from `megatron.training.global_vars` (upstream's module, whose `set_global_variables()` also sets them up); the
training code imports them from here."""

_ARGS = None
_TOKENIZER = None
_TIMERS = None
_TENSORBOARD_WRITER = None
_WANDB_WRITER = None
_SIGNAL_HANDLER = None
_ENERGY_MONITOR = None


def set_args(args):
    global _ARGS
    _ARGS = args


def get_args():
    if _ARGS is None:
        raise RuntimeError("arguments are not set: call initialize_megatron() (or pretrain()) first")
    return _ARGS


def set_tokenizer(tokenizer):
    global _TOKENIZER
    _TOKENIZER = tokenizer


def get_tokenizer():
    if _TOKENIZER is None:
        raise RuntimeError("the tokenizer is not built: call megatron.training.global_vars.set_global_variables(args) "
                           "or initialize_megatron() (which pretrain() calls) first")
    return _TOKENIZER


def set_timers(timers):
    global _TIMERS
    _TIMERS = timers


def get_timers():
    """The `megatron.core.timers.Timers` of this run (--timing-log-level, --timing-log-option), set by
    `initialize_megatron()` (which `pretrain()` calls) or `set_global_variables()`; as upstream, an error before."""
    if _TIMERS is None:
        raise RuntimeError("timers is not initialized: call initialize_megatron() or "
                           "megatron.training.global_vars.set_global_variables(args) first")
    return _TIMERS


def timers_or_none():
    """The timers `get_timers()` returns, or None where none are set (`megatron.core.timers.timed` then times
    nothing): for code that also runs outside `pretrain()`."""
    return _TIMERS


def set_scalar_writers(tensorboard_writer, wandb_writer):
    """Share the training log's writers (None, None when it closes them)."""
    global _TENSORBOARD_WRITER, _WANDB_WRITER
    _TENSORBOARD_WRITER, _WANDB_WRITER = tensorboard_writer, wandb_writer


def get_tensorboard_writer():
    """The `torch.utils.tensorboard.SummaryWriter` of --tensorboard-dir that the training log writes to, from the
    start of training on the last rank; None elsewhere, without --tensorboard-dir, or without TensorBoard
    installed (as upstream: scripts call `add_scalar` when it is not None)."""
    return _TENSORBOARD_WRITER


def get_wandb_writer():
    """The W&B run of --wandb-project that the training log writes to, from the start of training on the last
    rank; None elsewhere or without --wandb-project (as upstream, scripts call `.log({name: value}, step)`)."""
    return _WANDB_WRITER


def set_signal_handler(handler):
    global _SIGNAL_HANDLER
    _SIGNAL_HANDLER = handler


def installed_signal_handler():
    """The installed --exit-signal-handler handler, or None."""
    return _SIGNAL_HANDLER


def get_signal_handler():
    """The --exit-signal-handler handler, installed by `initialize_megatron()` (or `set_global_variables()`) and
    kept until `pretrain()` returns: `signals_received()` lists, for every rank, whether it received
    --exit-signal (collective). The training loop itself saves a checkpoint and stops every rank once any rank
    received it."""
    if _SIGNAL_HANDLER is None:
        raise RuntimeError("get_signal_handler(): no signal handler is installed: it exists with "
                           "--exit-signal-handler, from initialize_megatron() until pretrain() returns (the "
                           "training loop saves a checkpoint and stops all ranks together when --exit-signal "
                           "arrives)")
    return _SIGNAL_HANDLER


def set_energy_monitor(monitor):
    global _ENERGY_MONITOR
    _ENERGY_MONITOR = monitor


def get_energy_monitor():
    """The --log-energy monitor the training log reads while `pretrain()` trains: `lap()` returns the joules all
    ranks' GPUs used since the previous lap (collective; the log line's energy then counts from there)."""
    if _ENERGY_MONITOR is None:
        raise RuntimeError("get_energy_monitor(): no energy monitor: it exists with --log-energy on NVIDIA GPUs "
                           "with pynvml installed (pip install nvidia-ml-py), while pretrain() trains")
    return _ENERGY_MONITOR


def get_one_logger():
    """None, as upstream returns without one-logger telemetry: there is none here (--enable-one-logger and the
    other one-logger flags are accepted and have no effect)."""
    return None


def get_adlr_autoresume():
    """None, as upstream returns without --adlr-autoresume (ADLR's cluster auto-resume, which does not exist
    here)."""
    return None

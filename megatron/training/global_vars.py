"""Process-wide handles set once by `initialize_megatron()` / `pretrain()`: the parsed arguments, the tokenizer
and the timers."""

_ARGS = None
_TOKENIZER = None
_TIMERS = None


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
        raise RuntimeError("the tokenizer is not built: call initialize_megatron() (or pretrain()) first")
    return _TOKENIZER


def set_timers(timers):
    global _TIMERS
    _TIMERS = timers


def get_timers():
    """The `megatron.core.timers.Timers` of this run (--timing-log-level, --timing-log-option); None outside
    `pretrain()` (`megatron.core.timers.timed` then times nothing)."""
    return _TIMERS


def unset_global_state():
    """Forget the arguments, tokenizer and timers (used by tests that initialise more than once per process)."""
    set_args(None)
    set_tokenizer(None)
    set_timers(None)

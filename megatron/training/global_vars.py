"""Process-wide handles set once by `initialize_megatron()`: the parsed arguments and the tokenizer."""

_ARGS = None
_TOKENIZER = None


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


def unset_global_state():
    """Forget the arguments and tokenizer (used by tests that initialise more than once per process)."""
    set_args(None)
    set_tokenizer(None)

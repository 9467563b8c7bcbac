"""SIGTERM handling under --exit-signal-handler: remember the signal, and let all ranks agree on it at an
iteration boundary.

A scheduler that preempts a job sends SIGTERM (torchrun forwards it to every rank, but not necessarily at the
same moment). As upstream, the handler is installed at start-up (`initialize_megatron()`), so a signal that
arrives while the model is built, a checkpoint loads or the final evaluation runs is recorded too. It only
records it; the training loop asks `received_on_any_rank()` before the first iteration and after each one, a
MAX all-reduce, so that every rank saves the same checkpoint and exits together. Without --exit-signal-handler,
as upstream, no handler is installed (the signal keeps its default action) and the loop makes no per-iteration
collective for it.
"""

import signal
from contextlib import nullcontext

import torch
import torch.distributed as dist

from megatron.training.global_state import installed_signal_handler, set_signal_handler


def exit_signal_handler_from_args(args):
    """The handler for --exit-signal when --exit-signal-handler is given, else one that never fires."""
    if args.exit_signal_handler:
        return SigtermHandler(signal.Signals[args.exit_signal])
    return NoSignalHandler()


def install_exit_signal_handler(args):
    """Start-up, as upstream's `set_global_variables()`: with --exit-signal-handler, --exit-signal is recorded
    from now on (until `uninstall_exit_signal_handler()`); `get_signal_handler()` returns the handler."""
    uninstall_exit_signal_handler()
    if args.exit_signal_handler:
        exit_signal_handler_from_args(args).__enter__()


def uninstall_exit_signal_handler():
    """Give the signal its previous action back (nothing to do when no handler is installed)."""
    handler = installed_signal_handler()
    if handler is not None:
        handler.__exit__(None, None, None)


def signal_handler_for_the_loop(args):
    """The handler the training loop asks (a context manager): the one installed at start-up, or, when `train()`
    runs without `initialize_megatron()`, one installed for the loop's duration."""
    handler = installed_signal_handler()
    return nullcontext(handler) if handler is not None else exit_signal_handler_from_args(args)


class NoSignalHandler:
    """No handler installed: the signal keeps its action, and no rank is ever asked."""

    received = False

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False

    def received_on_any_rank(self, device):
        return False


class SigtermHandler:
    def __init__(self, signal_number=signal.SIGTERM):
        self.signal_number = signal_number
        self.received = False
        self._previous_handler = None

    def __enter__(self):
        self._previous_handler = signal.signal(self.signal_number, self._record)
        set_signal_handler(self)  # upstream's get_signal_handler() returns it to scripts
        return self

    def __exit__(self, *exc_info):
        set_signal_handler(None)
        signal.signal(self.signal_number, self._previous_handler)
        return False

    def _record(self, signal_number, frame):
        self.received = True

    def signals_received(self):
        """Upstream's `signals_received()`: for every rank, whether it received the signal (collective)."""
        from megatron.core.device_utils import get_current_device

        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32, device=get_current_device())
        if not dist.is_initialized():
            return [bool(flag.item())]
        gathered = [torch.zeros_like(flag) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flag)
        return [bool(each.item()) for each in gathered]

    def received_on_any_rank(self, device):
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32, device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

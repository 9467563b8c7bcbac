"""The rerun state machine: validate results of a training step, and rerun a suspicious step to tell a transient
fault (a result that does not reproduce) from a persistent one (a result that does).

The training loop drives it around the forward-backward pass of every iteration::

    machine = get_rerun_state_machine()
    while machine.should_run_forward_backward(data_iterator):
        ...forward and backward of the global batch (the loss function calls machine.validate_result)...
    should_checkpoint, should_exit, exit_code = machine.should_checkpoint_and_exit()

`validate_result(result, rejection_func, message, tolerance, fatal)` is called where a result is produced (the
loss of a microbatch, the norm of the gradients). Its verdict is kept locally and agreed over all ranks with one
all-reduce when the pass ends, so a fault seen on one rank stops or reruns every rank in the same iteration and
no rank is left waiting in a collective.

Modes (`--rerun-mode`):
- `disabled`: one pass per iteration; a rejected fatal result raises RuntimeError on every rank (after the pass,
  once all ranks agree), a rejected non-fatal one is logged.
- `validate_results` (the default of `--rerun-mode`; a machine created without a mode is `disabled`, as
  upstream's): a rejected result reruns the iteration in place (same data, random state restored). A different
  result means a transient fault: exit with `EXIT_CODE_FAILED_ON_RESULT_VALIDATION` (17) after saving the last
  iteration's checkpoint. The same result means the fault may be persistent or the result correct: save the
  last iteration's checkpoint with this machine's state and exit with `EXIT_CODE_RESUME_TO_DISAMBIGUATE` (16).
  Resumed from that checkpoint on another node or device, the iteration runs a third time: a different result
  is a persistent fault of the first device, the same result a correct result (an application problem), both
  exit 17 (a non-fatal check continues training instead); resumed on the same node and device, it exits 16
  again.
- `report_stats`: every iteration runs twice and the relative differences of each validated result between the
  two runs are collected and printed (nondeterminism statistics); nothing stops training.

Fault injection (`--error-injection-rate N`, `--error-injection-type`), for testing the paths above: in
`validate_results` mode, each validation of a training step is rejected with probability 1/N (N=1: the first of
every step), and the reruns then behave as the injected kind of fault would: `transient_error` does not
reproduce in place (exit 17); `correct_result` and `persistent_error` do (exit 16), and after a resume on
another node or device the first matches again (a correct result) while the second does not.

`--result-rejected-tracker-filename`: every rejected result (and the verdict on it) is appended as one line to
this file, so that jobs resuming the run can see what was rejected before.

The optimizer step is never taken for a step that fails validation: the loop exits before it, so no checkpoint
holds weights updated by a bad step.
"""

import datetime
import enum
import logging
import math
import numbers
import random
import socket
from collections import defaultdict
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from megatron.core.random_state_snapshot import capture_random_state, restore_random_state
from megatron.core.rerun_comparison import DifferenceStats, relative_difference
from megatron.core.rerun_data_iterator import (
    RerunDataIterator,
    as_rerun_iterators,
    rerun_iterators_in,
    wrap_for_reruns,
)

logger = logging.getLogger(__name__)

EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17


class RerunMode(str, enum.Enum):
    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_STATS = "report_stats"
    REPORT_DETERMINISM_STATS = "report_stats"  # upstream's name of the same mode


class RerunState(enum.Enum):
    NOT_RUNNING_YET = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    WILL_RERUN_FROM_CHECKPOINT = 3
    RERUNNING_FROM_CHECKPOINT = 4
    RERUNNING_AGAIN_FROM_CHECKPOINT = 5


class RerunDiagnostic(str, enum.Enum):
    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


class ValidationCall(NamedTuple):
    """Which validation of the iteration: its message and how many times that message was validated before."""

    message: str
    sequence: int


def this_node_and_device():
    """(host name, device) this rank computes on: a resumed rerun must run elsewhere to judge the result."""
    from megatron.core.device_utils import get_current_device

    return socket.gethostname(), str(get_current_device())


class RerunErrorInjector:
    """Fault injection for testing the rerun paths (upstream's class): each validation of a training step is
    rejected with probability 1/`error_injection_rate` (0: never), and its reruns behave as a fault of
    `error_injection_type` would (see the module docstring)."""

    def __init__(self, error_injection_rate=0, error_injection_type=RerunDiagnostic.TRANSIENT_ERROR):
        if isinstance(error_injection_rate, bool) or not isinstance(error_injection_rate, numbers.Integral) or \
                error_injection_rate < 0:
            raise ValueError(f"error_injection_rate (--error-injection-rate) must be an integer >= 0 (0: no "
                             f"injection, N: 1 in N checks), got {error_injection_rate!r}")
        try:
            self.error_injection_type = RerunDiagnostic(error_injection_type)
        except ValueError:
            raise ValueError(f"error_injection_type (--error-injection-type) must be one of "
                             f"{[kind.value for kind in RerunDiagnostic]}, got {error_injection_type!r}") from None
        self.error_injection_rate = int(error_injection_rate)

    @property
    def should_inject_errors(self):
        return self.error_injection_rate > 0


class RerunStateMachine:
    """See the module docstring. `report_interval`: iterations between the statistics lines of report_stats.
    `state_save_func() -> state` and `state_restore_func(state)` (upstream's hooks): state of the caller's own,
    beyond the random generators (always restored), saved before each training step and put back before its
    rerun. `error_injector`: a `RerunErrorInjector`, as upstream passes it (or `error_injection_rate` and
    `error_injection_type`)."""

    def __init__(self, mode=RerunMode.DISABLED, report_interval=100, error_injection_rate=0,
                 error_injection_type=RerunDiagnostic.TRANSIENT_ERROR, result_rejected_tracker_filename=None, *,
                 state_save_func=None, state_restore_func=None, error_injector=None):
        if callable(mode):
            raise TypeError("RerunStateMachine's first positional argument is the mode; pass state_save_func and "
                            "state_restore_func by keyword")
        if (state_save_func is None) != (state_restore_func is None):
            raise ValueError("state_save_func and state_restore_func go together: state_save_func() is called "
                             "before each training step and state_restore_func(saved) before its rerun; pass both "
                             "or neither")
        if error_injector is not None and error_injection_rate:
            raise ValueError("pass the fault injection either as error_injector=RerunErrorInjector(rate, type) or "
                             "as error_injection_rate/error_injection_type, not both")
        self.mode = RerunMode(mode)
        self.report_interval = report_interval
        self.error_injector = error_injector or RerunErrorInjector(error_injection_rate, error_injection_type)
        # Extra state (beyond the random generators, always restored) to put back before a rerun.
        self.state_save_func = state_save_func
        self.state_restore_func = state_restore_func
        self._saved_extra_state = None
        # A generator of its own: injecting must not move the random state the training step draws from.
        self._injection_random = random.Random(f"rerun-error-injection-{_rank()}")
        self.result_rejected_tracker_filename = result_rejected_tracker_filename
        self.state = RerunState.NOT_RUNNING_YET
        self.current_iteration = 0
        self._call_counts = defaultdict(int)
        self._saved_random_state = None
        self._resumed_to_rerun = False
        self._reset_step_flags()
        self._forget_rejected_result()
        self.saved_results = {}
        self.stats = defaultdict(DifferenceStats)
        self.large_value_counts = {}
        self.max_values = {}

    @property
    def error_injection_rate(self):
        return self.error_injector.error_injection_rate

    @property
    def error_injection_type(self):
        return self.error_injector.error_injection_type

    def get_mode(self):
        return self.mode

    def set_mode(self, mode):
        """Switch mode between steps (evaluation runs with `RerunMode.DISABLED`)."""
        if self.state in (RerunState.INITIAL_RUN, RerunState.RERUNNING_IN_PLACE, RerunState.RERUNNING_FROM_CHECKPOINT):
            raise RuntimeError(f"set_mode inside a forward-backward pass (state {self.state.name})")
        self.mode = RerunMode(mode)

    def _reset_step_flags(self):
        self.rerun_requested = False
        self.checkpoint_requested = False
        self.restart_again_requested = False
        self.continue_requested = False
        self.fatal_failure = None

    def _forget_rejected_result(self):
        """A new step: what an earlier step rejected (then found correct, training went on) is not this step's."""
        self.failed_call = None
        self.initial_result = None
        self.injected_error_type = None
        self.suspicious_node_and_device = None
        self.diagnostic = None

    # ---- the loop around forward-backward ----------------------------------------------------------------------
    def should_run_forward_backward(self, data_iterator):
        """True while the forward-backward pass of this iteration must (re)run; call it in a `while` loop."""
        self._call_counts = defaultdict(int)
        iterators = as_rerun_iterators(data_iterator) if self.mode != RerunMode.DISABLED else []
        if self.state == RerunState.NOT_RUNNING_YET:
            self._reset_step_flags()
            self._forget_rejected_result()
            self.current_iteration += 1
            if self.mode != RerunMode.DISABLED:
                self._saved_random_state = capture_random_state()
                self._saved_extra_state = self.state_save_func() if self.state_save_func is not None else None
                for iterator in iterators:
                    iterator.advance()
            else:
                for iterator in rerun_iterators_in(data_iterator):
                    iterator.stop_recording()  # reruns were on in earlier steps: keep no batch from now on
            self.state = RerunState.INITIAL_RUN
            return True
        if self.state == RerunState.WILL_RERUN_FROM_CHECKPOINT and self._resumed_to_rerun:
            # Resumed from the checkpoint saved to disambiguate: the suspicious iteration runs a third time. Its data
            # is the same: the data iterators restart after the samples the checkpoint consumed.
            self._reset_step_flags()
            self.current_iteration += 1
            self._resumed_to_rerun = False
            self.state = RerunState.RERUNNING_FROM_CHECKPOINT
            return True
        if self.state == RerunState.INITIAL_RUN:
            return self._after_initial_run(iterators)
        if self.state == RerunState.RERUNNING_IN_PLACE:
            return self._after_rerun_in_place(iterators)
        if self.state == RerunState.RERUNNING_FROM_CHECKPOINT:
            return self._after_rerun_from_checkpoint()
        raise RuntimeError(f"should_run_forward_backward called in state {self.state.name}")

    def _after_initial_run(self, iterators):
        if self.mode == RerunMode.DISABLED:
            failure = self._any_rank(self.fatal_failure is not None)
            self.state = RerunState.NOT_RUNNING_YET
            if failure:
                raise RuntimeError(self.fatal_failure or f"iteration {self.current_iteration}: a rejected result on "
                                   "another rank (--rerun-mode disabled); see that rank's log")
            return False
        if not self._any_rank(self.rerun_requested):
            self.state = RerunState.NOT_RUNNING_YET
            return False
        if self.mode == RerunMode.VALIDATE_RESULTS and _rank() == 0:
            logger.warning(f"iteration {self.current_iteration}: rerunning the step in place to check whether the "
                           "rejected result reproduces")
        self._rewind(iterators)
        self.state = RerunState.RERUNNING_IN_PLACE
        return True

    def _after_rerun_in_place(self, iterators):
        if self.mode == RerunMode.REPORT_STATS:
            self.state = RerunState.NOT_RUNNING_YET
            self.saved_results = {}
            if self.report_interval and self.current_iteration % self.report_interval == 0:
                self.report_stats()
            return False
        if self._any_rank(self.checkpoint_requested):
            # Reproduced: leave the model, random state and data as they were before the step, to be saved.
            self._rewind(iterators)
            self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
            self.diagnostic = None
        else:
            self.diagnostic = RerunDiagnostic.TRANSIENT_ERROR
        return False

    def _after_rerun_from_checkpoint(self):
        if self._any_rank(self.restart_again_requested):
            if _rank() == 0:
                logger.warning("resumed on the node and device that produced the rejected result: resume again "
                               "from the same checkpoint elsewhere to establish a diagnostic")
            self.state = RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT
        elif self._any_rank(self.continue_requested):
            if _rank() == 0:
                logger.warning("the rejected result was correct and its check is not fatal: training continues")
            if self.failed_call is not None:
                self._track_rejected_result("verdict\trerun on another node or device\tdiagnostic=correct_result\t"
                                            "training continues")
            self.state = RerunState.NOT_RUNNING_YET
        return False

    def _rewind(self, iterators):
        restore_random_state(self._saved_random_state)
        if self._saved_extra_state is not None:
            self.state_restore_func(self._saved_extra_state)
        for iterator in iterators:
            iterator.rewind()

    def should_checkpoint_and_exit(self):
        """(save a checkpoint of the last completed iteration, stop training, exit code) after the loop."""
        if self.mode != RerunMode.VALIDATE_RESULTS:
            return False, False, 0
        rank0 = _rank() == 0
        if self.state == RerunState.RERUNNING_IN_PLACE:
            if rank0:
                logger.warning("the rejected result did not reproduce (transient fault): saving the last "
                               f"iteration's checkpoint and exiting with {EXIT_CODE_FAILED_ON_RESULT_VALIDATION}")
            return self._verdict(True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION, "did not reproduce in place")
        if self.state == RerunState.WILL_RERUN_FROM_CHECKPOINT:
            if rank0:
                logger.warning("the rejected result reproduced: saving the last iteration's checkpoint and exiting "
                               f"with {EXIT_CODE_RESUME_TO_DISAMBIGUATE}; resume from it on another node or device "
                               "to establish a diagnostic")
            return self._verdict(True, EXIT_CODE_RESUME_TO_DISAMBIGUATE, "reproduced in place")
        if self.state == RerunState.RERUNNING_FROM_CHECKPOINT:
            return self._verdict(False, EXIT_CODE_FAILED_ON_RESULT_VALIDATION, "rerun on another node or device")
        if self.state == RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT:
            return self._verdict(False, EXIT_CODE_RESUME_TO_DISAMBIGUATE, "resumed on the same node and device")
        return False, False, 0

    def _verdict(self, should_checkpoint, exit_code, what):
        """The decision of `should_checkpoint_and_exit`, tracked by the ranks that rejected the result."""
        if self.failed_call is not None:
            diagnostic = self.diagnostic.value if self.diagnostic is not None else "undetermined"
            self._track_rejected_result(f"verdict\t{what}\tdiagnostic={diagnostic}\texit={exit_code}")
        return should_checkpoint, True, exit_code

    def _any_rank(self, flag):
        """True on every rank when `flag` is true on at least one (one all-reduce over the default group)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return bool(flag)
        from megatron.core.device_utils import get_current_device

        value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=get_current_device())
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    # ---- validation -------------------------------------------------------------------------------------------
    def validate_result(self, result, rejection_func: Callable, message="unexpected result",
                        comparison_func: Optional[Callable] = None, tolerance=0.0, fatal=True):
        """Check `result` (a number or one-element tensor) with `rejection_func(result) -> bool`.

        `comparison_func(initial, rerun) -> float` (default: `relative_difference`) measures how far a rerun's
        result is from the rejected one; above `tolerance` it did not reproduce. `fatal=False` lets training
        continue once a rejected result is shown correct. Called outside the forward-backward loop (evaluation),
        a rejected result is logged and nothing else happens.
        """
        comparison_func = comparison_func or relative_difference
        call = ValidationCall(message, self._call_counts[message])
        self._call_counts[message] += 1
        where = f"rank {_rank()}, iteration {self.current_iteration}"

        if self.mode == RerunMode.DISABLED or self.state == RerunState.NOT_RUNNING_YET:
            # Outside a training step (evaluation, calibration loops) a rejected result is only logged.
            if bool(rejection_func(result)):
                text = f"{where}: unexpected result {_as_float(result)} ({message})"
                if fatal and self.fatal_failure is None and self.state != RerunState.NOT_RUNNING_YET:
                    self.fatal_failure = text
                logger.error(text) if fatal else logger.warning(text)
            return

        if self.mode == RerunMode.REPORT_STATS:
            if self.state == RerunState.INITIAL_RUN:
                self.rerun_requested = True
                self.saved_results[call] = _as_float(result)
            elif self.state == RerunState.RERUNNING_IN_PLACE and call in self.saved_results:
                self.stats[message].record(comparison_func(self.saved_results[call], _as_float(result)))
            return

        if self.state == RerunState.INITIAL_RUN:
            if self.rerun_requested:
                return
            injected = self._should_inject_error()
            if injected or bool(rejection_func(result)):
                self.rerun_requested = True
                self.failed_call = call
                self.initial_result = _as_float(result)
                self.injected_error_type = self.error_injection_type if injected else None
                kind = f"injected {self.error_injection_type.value}" if injected else "unexpected result"
                logger.error(f"{where}: {kind} {self.initial_result} ({message}, check #{call.sequence})")
                self._track_rejected_result(f"rejected\tresult={self.initial_result}\tinjected="
                                            f"{self.injected_error_type.value if injected else 'no'}\t"
                                            f"message={message}")
            return
        if call != self.failed_call:
            return
        difference = comparison_func(self.initial_result, _as_float(result))
        reproduced = difference <= tolerance
        if self.injected_error_type is not None:
            reproduced = self._injected_fault_reproduces()
        if self.state == RerunState.RERUNNING_IN_PLACE:
            if reproduced:
                self.checkpoint_requested = True
                self.suspicious_node_and_device = this_node_and_device()
                logger.warning(f"{where}: the rerun reproduced the rejected result ({_as_float(result)}); it must "
                               "run again on another device to tell a persistent fault from a correct result")
            else:
                logger.error(f"{where}: the rerun gave {_as_float(result)} instead of {self.initial_result}"
                             f"{self._injected_note()}: possible transient fault")
        elif self.state == RerunState.RERUNNING_FROM_CHECKPOINT:
            if this_node_and_device() == tuple(self.suspicious_node_and_device):
                self.restart_again_requested = True
                logger.error(f"{where}: resumed on the node and device that produced the rejected result "
                             f"({self.suspicious_node_and_device})")
            elif not reproduced:
                self.diagnostic = RerunDiagnostic.PERSISTENT_ERROR
                logger.error(f"{where}: another device gave {_as_float(result)} instead of {self.initial_result}"
                             f"{self._injected_note()}: possible persistent fault of the first device")
            else:
                self.diagnostic = RerunDiagnostic.CORRECT_RESULT
                logger.error(f"{where}: another device reproduced {self.initial_result}: the result is correct "
                             f"(possible application problem: {message})")
                self.continue_requested = not fatal

    def _injected_note(self):
        """Why an injected fault's rerun counts as different although its value is the same."""
        if self.injected_error_type is None:
            return ""
        return (f" (taken as different: the fault was injected by --error-injection-type "
                f"{self.injected_error_type.value}, which does not reproduce here)")

    def _should_inject_error(self):
        return self.error_injection_rate > 0 and self._injection_random.randrange(self.error_injection_rate) == 0

    def _injected_fault_reproduces(self):
        """How an injected fault behaves when its step runs again: in place, only a transient one differs; on
        another device, a correct result still matches and a persistent fault of the first device does not."""
        if self.state == RerunState.RERUNNING_IN_PLACE:
            return self.injected_error_type != RerunDiagnostic.TRANSIENT_ERROR
        return self.injected_error_type == RerunDiagnostic.CORRECT_RESULT

    def _track_rejected_result(self, text):
        """One line in --result-rejected-tracker-filename (appended by the rank concerned)."""
        if self.result_rejected_tracker_filename is None:
            return
        stamp = datetime.datetime.now().isoformat(timespec="seconds")
        node, device = this_node_and_device()
        with open(self.result_rejected_tracker_filename, "a") as stream:
            stream.write(f"{stamp}\titeration={self.current_iteration}\trank={_rank()}\tnode={node}\t"
                         f"device={device}\t{text}\n")

    def is_unexpectedly_large(self, result, threshold, context, num_samples=100, resample=False):
        """Whether |result| >= `threshold` x the largest |value| among the first `num_samples` values of
        `context` (a rejection function for spiky losses or gradients). The first `num_samples` values only
        build the reference; the first iteration is skipped (a machine that no `should_run_forward_backward` loop
        drives, as in a training loop of one's own, stays at iteration 0 and counts every value); NaN and Inf are
        left to their own checks."""
        value = abs(_as_float(result))
        if math.isnan(value) or math.isinf(value) or self.current_iteration == 1:
            return False
        if resample or context not in self.large_value_counts:
            self.large_value_counts[context] = 0
            self.max_values[context] = 0.0
        if self.large_value_counts[context] < num_samples:
            self.large_value_counts[context] += 1
            self.max_values[context] = max(self.max_values[context], value)
            return False
        return value >= threshold * self.max_values[context]

    def report_stats(self):
        """Print the rerun difference statistics (report_stats mode) on rank 0."""
        if _rank() == 0 and self.stats:
            lines = [f"  {message}: {stats.summary()}" for message, stats in sorted(self.stats.items())]
            print(f"rerun statistics at iteration {self.current_iteration}:\n" + "\n".join(lines), flush=True)

    # ---- checkpoint ------------------------------------------------------------------------------------------
    def state_dict(self, data_iterator=None, ckpt_format=None):
        """This rank's state to save with the checkpoint when it must resume to rerun; None otherwise.

        `data_iterator` and `ckpt_format` are taken as upstream's checkpoint code passes them, and not needed:
        the resumed data iterators start after the checkpoint's consumed samples, at the rejected step's data."""
        if self.state != RerunState.WILL_RERUN_FROM_CHECKPOINT:
            return None
        return {
            "mode": self.mode.value,
            # None on the ranks whose results were accepted.
            "failed_call": None if self.failed_call is None else tuple(self.failed_call),
            "initial_result": self.initial_result,
            "suspicious_node_and_device": self.suspicious_node_and_device,
            "injected_error_type": None if self.injected_error_type is None else self.injected_error_type.value,
        }

    def load_state_dict(self, state):
        """Resume to rerun the iteration after the checkpoint (state from `state_dict`)."""
        if self.mode != RerunMode.VALIDATE_RESULTS:
            logger.warning(f"the checkpoint asks to rerun its next iteration, but --rerun-mode is {self.mode.value}: "
                           "no rerun")
            return
        self.failed_call = None if state["failed_call"] is None else ValidationCall(*state["failed_call"])
        self.initial_result = state["initial_result"]
        where = state["suspicious_node_and_device"]
        self.suspicious_node_and_device = None if where is None else tuple(where)
        injected = state.get("injected_error_type")
        self.injected_error_type = None if injected is None else RerunDiagnostic(injected)
        self._resumed_to_rerun = True
        self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT


def _as_float(result):
    return float(result.item() if torch.is_tensor(result) else result)


def _rank():
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


_STATE_MACHINE = None


def initialize_rerun_state_machine(mode=RerunMode.DISABLED, report_interval=100, **options):
    """Set the process's machine. `options`, as upstream: state_save_func, state_restore_func, error_injector
    (a `RerunErrorInjector`), result_rejected_tracker_filename; or error_injection_rate and error_injection_type."""
    global _STATE_MACHINE
    _STATE_MACHINE = RerunStateMachine(mode, report_interval, **options)
    return _STATE_MACHINE


def get_rerun_state_machine():
    """The process's machine. As upstream, when none was initialized one is created on first use, in mode
    `disabled` (a rejected fatal result raises), with a warning: `pretrain()` initializes it from --rerun-mode; a
    loop of its own calls `initialize_rerun_state_machine(mode=...)` for reruns."""
    if _STATE_MACHINE is None:
        logger.warning("Implicit initialization of Rerun State Machine!")
        initialize_rerun_state_machine()
    return _STATE_MACHINE


def destroy_rerun_state_machine():
    global _STATE_MACHINE
    _STATE_MACHINE = None


__all__ = [
    "EXIT_CODE_FAILED_ON_RESULT_VALIDATION",
    "EXIT_CODE_RESUME_TO_DISAMBIGUATE",
    "RerunDataIterator",
    "wrap_for_reruns",
    "RerunDiagnostic",
    "RerunErrorInjector",
    "RerunMode",
    "RerunState",
    "RerunStateMachine",
    "destroy_rerun_state_machine",
    "get_rerun_state_machine",
    "initialize_rerun_state_machine",
    "relative_difference",
]

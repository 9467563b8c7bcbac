"""How many microbatches make one global batch: a process-wide calculator set up once from the batch flags.

Every data-parallel rank runs `num_microbatches` microbatches of `micro_batch_size` samples per step, so
`global_batch_size = num_microbatches * micro_batch_size * data_parallel_size` must hold exactly; the
training loop, the data samplers and the pipeline schedules all read the same numbers from here.

`--decrease-batch-size-if-needed` relaxes that: a global batch size (or a step of a `--rampup-batch-size` ramp)
that does not split evenly runs as the largest multiple of micro-batch x data-parallel size below it, the
*running* global batch size. Relaunching with a data-parallel size that divides it restores the full size.
"""

import dataclasses
import logging

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ConstantNumMicroBatchesCalculator:
    """A fixed global batch split into equal microbatches on every data-parallel rank."""

    global_batch_size: int
    micro_batch_size: int
    data_parallel_size: int
    decrease_batch_size_if_needed: bool = False

    def __post_init__(self):
        for flag, value in (
            ("--global-batch-size", self.global_batch_size),
            ("--micro-batch-size", self.micro_batch_size),
            ("data-parallel size", self.data_parallel_size),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")
        samples_per_microbatch_step = self.micro_batch_size * self.data_parallel_size
        if self.decrease_batch_size_if_needed:
            running_global_batch_size(self.global_batch_size, samples_per_microbatch_step, "--global-batch-size")
        elif self.global_batch_size % samples_per_microbatch_step != 0:
            raise ValueError(
                f"--global-batch-size ({self.global_batch_size}) must be divisible by --micro-batch-size "
                f"({self.micro_batch_size}) times the data-parallel size ({self.data_parallel_size}) = "
                f"{samples_per_microbatch_step}; choose a global batch size that is a multiple of "
                f"{samples_per_microbatch_step}, change the micro batch size or the number of data-parallel ranks, "
                "or pass --decrease-batch-size-if-needed to run the largest multiple below it"
            )

    @property
    def num_microbatches(self):
        return self.current_running_global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    @property
    def current_global_batch_size(self):
        return self.global_batch_size

    @property
    def current_running_global_batch_size(self):
        """The samples a step actually runs: the global batch size, decreased to a multiple of micro-batch x
        data-parallel size under `--decrease-batch-size-if-needed`."""
        if not self.decrease_batch_size_if_needed:
            return self.global_batch_size
        return running_global_batch_size(self.global_batch_size, self.micro_batch_size * self.data_parallel_size,
                                         "--global-batch-size")


class RampupBatchsizeNumMicroBatchesCalculator:
    """`--rampup-batch-size start increment samples`: the global batch starts at `start` and grows by `increment`
    every `samples / ((global_batch_size - start) / increment)` consumed samples until `samples` have been
    consumed, then stays at `global_batch_size` (upstream's ramp). Every size must split into microbatches, or,
    with `decrease_batch_size_if_needed`, runs as the largest multiple of micro-batch x data-parallel size below
    it (`current_running_global_batch_size`; consumed samples count what ran)."""

    def __init__(self, global_batch_size, micro_batch_size, data_parallel_size, start_global_batch_size,
                 batch_size_increment, rampup_samples, decrease_batch_size_if_needed=False):
        ConstantNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size,
                                          decrease_batch_size_if_needed)
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.start_global_batch_size, self.batch_size_increment = start_global_batch_size, batch_size_increment
        self.rampup_samples = rampup_samples
        self.decrease_batch_size_if_needed = decrease_batch_size_if_needed
        check_rampup(global_batch_size, micro_batch_size * data_parallel_size, start_global_batch_size,
                     batch_size_increment, rampup_samples, decrease_batch_size_if_needed)
        increments = (global_batch_size - start_global_batch_size) // batch_size_increment
        # No ramp when the start is the full size or the ramp spans no samples: every step runs the full size.
        self.rampup_samples_per_increment = rampup_samples / increments if increments and rampup_samples else None
        self.update(0)

    def update(self, consumed_samples, consistency_check=True):
        if self.rampup_samples_per_increment is None or consumed_samples > self.rampup_samples:
            self.current_global_batch_size = self.global_batch_size
        else:
            steps = int(consumed_samples / self.rampup_samples_per_increment)
            self.current_global_batch_size = self.start_global_batch_size + steps * self.batch_size_increment
        samples_per_microbatch_step = self.micro_batch_size * self.data_parallel_size
        if self.decrease_batch_size_if_needed:
            self.current_running_global_batch_size = running_global_batch_size(
                self.current_global_batch_size, samples_per_microbatch_step, "--rampup-batch-size")
            return
        if consistency_check and self.current_global_batch_size % samples_per_microbatch_step != 0:
            raise ValueError(f"--rampup-batch-size: global batch size {self.current_global_batch_size} is not a "
                             f"multiple of --micro-batch-size x data-parallel size ({samples_per_microbatch_step})")
        self.current_running_global_batch_size = self.current_global_batch_size

    @property
    def num_microbatches(self):
        return self.current_running_global_batch_size // (self.micro_batch_size * self.data_parallel_size)


def running_global_batch_size(global_batch_size, samples_per_microbatch_step, flag):
    """`--decrease-batch-size-if-needed`: the largest multiple of micro-batch x data-parallel size (the samples of
    one microbatch on every data-parallel rank) not above `global_batch_size`, which `flag` set."""
    running = global_batch_size // samples_per_microbatch_step * samples_per_microbatch_step
    if running == 0:
        raise ValueError(f"{flag}: global batch size {global_batch_size} is below one microbatch on every "
                         f"data-parallel rank (--micro-batch-size x data-parallel size = "
                         f"{samples_per_microbatch_step}), so --decrease-batch-size-if-needed would leave nothing "
                         "to run; raise it, or lower the micro batch size or the number of data-parallel ranks")
    return running


def check_rampup(global_batch_size, samples_per_microbatch_step, start, increment, rampup_samples,
                 decrease_batch_size_if_needed=False):
    """Upstream's rules for `--rampup-batch-size start increment samples`, plus: every size on the ramp splits
    into whole microbatches on every data-parallel rank (with `decrease_batch_size_if_needed`: holds at least
    one). Raises ValueError naming the flag."""
    if start <= 0 or increment <= 0 or rampup_samples < 0:
        raise ValueError(f"--rampup-batch-size {start} {increment} {rampup_samples}: the start and increment must "
                         "be positive and the ramp-up samples non-negative")
    if start > global_batch_size or (global_batch_size - start) % increment != 0:
        raise ValueError(f"--rampup-batch-size: --global-batch-size ({global_batch_size}) minus the start "
                         f"({start}) must be a non-negative multiple of the increment ({increment})")
    if decrease_batch_size_if_needed:
        running_global_batch_size(start, samples_per_microbatch_step, "--rampup-batch-size start")
    elif start % samples_per_microbatch_step or increment % samples_per_microbatch_step:
        raise ValueError(f"--rampup-batch-size: the start ({start}) and increment ({increment}) must be multiples "
                         f"of --micro-batch-size x data-parallel size ({samples_per_microbatch_step}); or pass "
                         "--decrease-batch-size-if-needed to run each step's largest multiple of it")


def rampup_train_iters(train_samples, global_batch_size, micro_batch_size, data_parallel_size, rampup_batch_size,
                       decrease_batch_size_if_needed=False):
    """Iterations of sample-based training with a batch-size ramp, counted as upstream: steps of the current size
    while at most the ramp-up samples (and the training samples) are consumed, then whole global batches of the
    rest (a partial last batch is dropped). Steps count the samples they run: under
    `decrease_batch_size_if_needed` the running (decreased) sizes, as the training loop counts them."""
    calculator = RampupBatchsizeNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size,
                                                          *rampup_batch_size, decrease_batch_size_if_needed)
    iterations = consumed = 0
    while consumed <= calculator.rampup_samples and consumed <= train_samples:
        calculator.update(consumed)
        consumed += calculator.current_running_global_batch_size
        iterations += 1
    calculator.update(calculator.rampup_samples + 1)
    if train_samples > consumed:
        iterations += (train_samples - consumed) // calculator.current_running_global_batch_size
    return iterations


_CALCULATOR = None


def init_num_microbatches_calculator(rank, rampup_batch_size, global_batch_size, micro_batch_size,
                                     data_parallel_size, decrease_batch_size_if_needed=False):
    """Set up the process-wide calculator (Megatron-Core's positional order): constant, or ramping up with
    `rampup_batch_size` = (start, increment, ramp-up samples) (ints, or the strings of `--rampup-batch-size`).
    Raises ValueError when the batch sizes do not divide evenly, unless `decrease_batch_size_if_needed`
    (`--decrease-batch-size-if-needed`) lets each step run the largest multiple of micro-batch x data-parallel size
    below its size."""
    if _CALCULATOR is not None:
        raise RuntimeError(
            "the num-microbatches calculator is already initialised; call destroy_num_microbatches_calculator() "
            "(or reconfigure_num_microbatches_calculator()) to set it up again"
        )
    return _configure(rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
                      decrease_batch_size_if_needed)


def reconfigure_num_microbatches_calculator(rank, rampup_batch_size, global_batch_size, micro_batch_size,
                                            data_parallel_size, decrease_batch_size_if_needed=False):
    """Replace the process-wide calculator (e.g. for evaluation at another batch size); same arguments as
    `init_num_microbatches_calculator`."""
    return _configure(rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
                      decrease_batch_size_if_needed)


def _rampup_triple(rampup_batch_size):
    if isinstance(rampup_batch_size, (str, bytes)) or len(rampup_batch_size) != 3:
        raise ValueError(f"--rampup-batch-size {rampup_batch_size!r}: expected three values, the start global batch "
                         "size, the increment and the ramp-up samples")
    try:
        return tuple(int(value) for value in rampup_batch_size)
    except (TypeError, ValueError):
        raise ValueError(f"--rampup-batch-size {list(rampup_batch_size)}: the start, increment and ramp-up samples "
                         "must be integers") from None


def _configure(rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
               decrease_batch_size_if_needed):
    global _CALCULATOR
    if rampup_batch_size is not None:
        rampup_batch_size = _rampup_triple(rampup_batch_size)
        _CALCULATOR = RampupBatchsizeNumMicroBatchesCalculator(global_batch_size, micro_batch_size,
                                                               data_parallel_size, *rampup_batch_size,
                                                               decrease_batch_size_if_needed)
        if rank == 0:
            logger.info("global batch size ramps from %d by %d over %d samples to %d", *rampup_batch_size,
                        global_batch_size)
        return _CALCULATOR
    calculator = ConstantNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size,
                                                   decrease_batch_size_if_needed)
    if rank == 0:
        logger.info(
            "global batch size %d = %d microbatches x micro batch size %d x data-parallel size %d",
            calculator.current_running_global_batch_size,
            calculator.num_microbatches,
            micro_batch_size,
            data_parallel_size,
        )
    _CALCULATOR = calculator
    return calculator


def _calculator():
    if _CALCULATOR is None:
        raise RuntimeError(
            "the num-microbatches calculator is not initialised; call init_num_microbatches_calculator() first"
        )
    return _CALCULATOR


def get_num_microbatches():
    return _calculator().num_microbatches


def get_current_global_batch_size():
    return _calculator().current_global_batch_size


def get_current_running_global_batch_size():
    """The samples the current step runs: the current global batch size, decreased to a multiple of micro-batch
    x data-parallel size under `--decrease-batch-size-if-needed` (else the same)."""
    return _calculator().current_running_global_batch_size


def get_micro_batch_size():
    return _calculator().micro_batch_size


def update_num_microbatches(consumed_samples, consistency_check=True, verbose=False):
    """Move a ramping global batch size to where `consumed_samples` puts it; a constant one never changes.
    `verbose` logs the new sizes when they change."""
    calculator = _calculator()
    if not isinstance(calculator, RampupBatchsizeNumMicroBatchesCalculator):
        return
    before = calculator.current_global_batch_size
    calculator.update(consumed_samples, consistency_check)
    if verbose and calculator.current_global_batch_size != before:
        logger.info("after %d consumed samples the global batch size is %d (running %d, %d microbatches)",
                    consumed_samples, calculator.current_global_batch_size,
                    calculator.current_running_global_batch_size, calculator.num_microbatches)


def num_microbatches_calculator_is_initialized():
    return _CALCULATOR is not None


def destroy_num_microbatches_calculator():
    """Forget the calculator (safe to call when none is set), e.g. between tests or runs."""
    global _CALCULATOR
    _CALCULATOR = None


unset_num_microbatches_calculator = destroy_num_microbatches_calculator

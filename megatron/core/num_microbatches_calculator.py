"""How many microbatches make one global batch: a process-wide calculator set up once from the batch flags.

Every data-parallel rank runs `num_microbatches` microbatches of `micro_batch_size` samples per step, so
`global_batch_size = num_microbatches * micro_batch_size * data_parallel_size` must hold exactly; the
training loop, the data samplers and the pipeline schedules all read the same numbers from here.
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

    def __post_init__(self):
        for flag, value in (
            ("--global-batch-size", self.global_batch_size),
            ("--micro-batch-size", self.micro_batch_size),
            ("data-parallel size", self.data_parallel_size),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")
        samples_per_microbatch_step = self.micro_batch_size * self.data_parallel_size
        if self.global_batch_size % samples_per_microbatch_step != 0:
            raise ValueError(
                f"--global-batch-size ({self.global_batch_size}) must be divisible by --micro-batch-size "
                f"({self.micro_batch_size}) times the data-parallel size ({self.data_parallel_size}) = "
                f"{samples_per_microbatch_step}; choose a global batch size that is a multiple of "
                f"{samples_per_microbatch_step}, or change the micro batch size or the number of data-parallel ranks"
            )

    @property
    def num_microbatches(self):
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    @property
    def current_global_batch_size(self):
        return self.global_batch_size


_CALCULATOR = None


def init_num_microbatches_calculator(rank, global_batch_size, micro_batch_size, data_parallel_size):
    """Set up the process-wide calculator; raises ValueError when the batch sizes do not divide evenly."""
    global _CALCULATOR
    if _CALCULATOR is not None:
        raise RuntimeError(
            "the num-microbatches calculator is already initialised; call destroy_num_microbatches_calculator() "
            "before initialising it again"
        )
    calculator = ConstantNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size)
    if rank == 0:
        logger.info(
            "global batch size %d = %d microbatches x micro batch size %d x data-parallel size %d",
            global_batch_size,
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


def get_micro_batch_size():
    return _calculator().micro_batch_size


def update_num_microbatches(consumed_samples, consistency_check=True):
    """The global batch size is constant, so the number of microbatches never changes with progress."""
    _calculator()


def num_microbatches_calculator_is_initialized():
    return _CALCULATOR is not None


def destroy_num_microbatches_calculator():
    """Forget the calculator (safe to call when none is set), e.g. between tests or runs."""
    global _CALCULATOR
    _CALCULATOR = None


unset_num_microbatches_calculator = destroy_num_microbatches_calculator

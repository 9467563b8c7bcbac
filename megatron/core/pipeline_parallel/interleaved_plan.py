"""The interleaved 1F1B schedule as pure arithmetic: which forward, backward and transfers each rank runs, in
which order (no processes, no tensors; `interleaved_schedule` executes the plan).

An interleaved (virtual) pipeline gives each of the `p` pipeline ranks `v` model chunks; chunk `c` of rank `r`
is virtual stage `c * p + r`, so an activation leaves rank `p - 1`'s chunk `c` for rank 0's chunk `c + 1` and
the ranks form a ring. Each rank runs `v * M` forwards and as many backwards ("virtual microbatches"). The order
of its forwards is the schedule table: per group of `N` consecutive microbatches
(`--microbatch-group-size-per-virtual-pipeline-stage`, default `p`), chunks `0 .. v-1` each run the whole group;
the backwards follow the same table with the chunks reversed. Rank `r` first runs
`2 (p - r - 1) + (v - 1) N` forwards (warm-up), then alternates one forward and one backward (steady state),
then runs the remaining backwards (cool-down). With `N = p = v = 2`, `M = 4` (F<microbatch><chunk>):

    rank 0: F00 F10 F01 F11 | F20 B01 | F30 B11 | F21 B00 | F31 B10 | B21 B31 B20 B30
    rank 1: F00 F10 | F01 B01 | F11 B11 | F20 B00 | F30 B10 | F21 B21 | F31 B31 | B20 B30

After each compute step a rank runs one exchange with its ring neighbours: it sends what the step produced (an
activation to the next rank, an input gradient to the previous one) and receives exactly what its next forward
and next backward need, so it only ever waits for tensors it is about to use. Sends are not waited for in the
exchange (they complete when the neighbour receives them; transfers of one kind between two ranks arrive in the
order they were sent). With groups of `p` microbatches every exchange also pairs with exactly one exchange of
each neighbour, in posting order, as NCCL's in-order matching of batched transfers needs.
`tests/unit_tests/pipeline_parallel/test_interleaved_plan.py` checks both by simulating all ranks.
"""

import dataclasses
from typing import Optional, Tuple

FLAG_GROUP_SIZE = "--microbatch-group-size-per-virtual-pipeline-stage"


def resolve_group_size(group_size, pipeline_size):
    """The microbatch group size `N`: the flag's value, or the pipeline size when unset."""
    return pipeline_size if group_size is None else group_size


def check_microbatches(num_microbatches, pipeline_size, group_size=None):
    """Raise ValueError unless `M` microbatches fit groups of `N`: `p <= N <= M` and `M mod N` is 0 or >= p.

    A last, shorter group of fewer than `p` microbatches would leave the pipeline waiting on itself. `group_size`
    None is the default `N = p` (the flag unset), where this means `M` must be a positive multiple of the pipeline
    size; the messages say which of the two applies.
    """
    microbatches = (f"the number of microbatches per global batch ({num_microbatches} = --global-batch-size / "
                    "(--micro-batch-size x data-parallel size))")
    if group_size is None:
        if num_microbatches < pipeline_size:
            raise ValueError(
                f"an interleaved pipeline needs {microbatches} to be at least --pipeline-model-parallel-size "
                f"({pipeline_size}): raise --global-batch-size"
            )
        if num_microbatches % pipeline_size != 0:
            raise ValueError(
                f"an interleaved pipeline with the default {FLAG_GROUP_SIZE} (the pipeline size) needs {microbatches} "
                f"to be a multiple of --pipeline-model-parallel-size ({pipeline_size}): change --global-batch-size, "
                f"or set {FLAG_GROUP_SIZE} N with {pipeline_size} <= N <= {num_microbatches} and "
                f"{num_microbatches} mod N either 0 or at least {pipeline_size}"
            )
        return
    if not pipeline_size <= group_size <= num_microbatches:
        raise ValueError(
            f"an interleaved pipeline needs {FLAG_GROUP_SIZE} ({group_size}) between --pipeline-model-parallel-size "
            f"({pipeline_size}) and {microbatches}"
        )
    remainder = num_microbatches % group_size
    if remainder != 0 and remainder < pipeline_size:
        raise ValueError(
            f"with an interleaved pipeline the number of microbatches ({num_microbatches}) modulo {FLAG_GROUP_SIZE} "
            f"({group_size}) must be 0 or at least --pipeline-model-parallel-size ({pipeline_size}), got {remainder}; "
            f"change --global-batch-size or {FLAG_GROUP_SIZE}"
        )


def schedule_table(num_microbatches, num_chunks, group_size):
    """[(microbatch, chunk)] of a rank's forwards in order, per group of `group_size` microbatches."""
    table = []
    for first in range(0, num_microbatches, group_size):
        group = range(first, min(first + group_size, num_microbatches))
        table.extend((microbatch, chunk) for chunk in range(num_chunks) for microbatch in group)
    return table


def num_warmup_forwards(pipeline_size, pipeline_rank, num_chunks, group_size, total, forward_only=False):
    """Forwards before the first backward: `2 (p - r - 1) + (v - 1) N`, at most all of them."""
    if forward_only:
        return total
    return min(2 * (pipeline_size - pipeline_rank - 1) + (num_chunks - 1) * group_size, total)


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of a rank: at most one forward and one backward (indices into the virtual microbatches), then
    one exchange. `recv_forward_chunk` / `recv_backward_chunk` name the chunk the received activation / output
    gradient is for (None: nothing received); the sends carry what this step's forward / backward produced."""

    forward: Optional[int] = None
    backward: Optional[int] = None
    send_forward: bool = False
    send_backward: bool = False
    recv_forward_chunk: Optional[int] = None
    recv_backward_chunk: Optional[int] = None


class InterleavedPlan:
    """The steps of pipeline rank `rank` of `pipeline_size`, with `num_chunks` chunks and `num_microbatches`."""

    def __init__(self, pipeline_size, rank, num_chunks, num_microbatches, group_size=None, forward_only=False):
        self.pipeline_size, self.rank, self.num_chunks = pipeline_size, rank, num_chunks
        self.num_microbatches = num_microbatches
        self.group_size = resolve_group_size(group_size, pipeline_size)
        check_microbatches(num_microbatches, pipeline_size, group_size)
        self.forward_only = forward_only
        self.table = schedule_table(num_microbatches, num_chunks, self.group_size)
        self.total = len(self.table)
        self.num_warmup = num_warmup_forwards(pipeline_size, rank, num_chunks, self.group_size, self.total,
                                              forward_only)
        self.num_steady = self.total - self.num_warmup
        self.is_first_rank = rank == 0
        self.is_last_rank = rank == pipeline_size - 1
        self.steps = self._build()

    # -- where each virtual microbatch goes ------------------------------------------------------------------

    def forward_of(self, k) -> Tuple[int, int]:
        """(microbatch, chunk) of the k-th forward."""
        return self.table[k % self.total]

    def backward_of(self, k) -> Tuple[int, int]:
        """(microbatch, chunk) of the k-th backward: the table with the chunks reversed."""
        microbatch, chunk = self.table[k % self.total]
        return microbatch, self.num_chunks - 1 - chunk

    def is_first_virtual_stage(self, chunk):
        return self.is_first_rank and chunk == 0

    def is_last_virtual_stage(self, chunk):
        return self.is_last_rank and chunk == self.num_chunks - 1

    def is_last_backward_of_chunk(self, k):
        """Whether backward k is the last one of its chunk (its gradients are then complete)."""
        _, chunk = self.backward_of(k)
        return all(self.backward_of(later)[1] != chunk for later in range(k + 1, self.total))

    # -- the plan --------------------------------------------------------------------------------------------

    def _sends_forward(self, k):
        return not self.is_last_virtual_stage(self.forward_of(k)[1])

    def _sends_backward(self, k):
        return not self.is_first_virtual_stage(self.backward_of(k)[1])

    def _needs_input(self, k):
        """Whether forward k receives its input (every chunk but the first virtual stage does)."""
        return k < self.total and not self.is_first_virtual_stage(self.forward_of(k)[1])

    def _needs_output_grad(self, k):
        """Whether backward k receives its output gradient (every chunk but the last virtual stage does)."""
        return k < self.total and not self.is_last_virtual_stage(self.backward_of(k)[1])

    def _build(self):
        # Each exchange receives what the rank's next forward and next backward need, so a rank waits only for
        # tensors it is about to use; its sends carry what the step just produced.
        steps = [self._exchange(Step(), 0, None)]
        for k in range(self.num_warmup):
            next_backward = 0 if k == self.num_warmup - 1 and not self.forward_only else None
            steps.append(self._exchange(Step(forward=k, send_forward=self._sends_forward(k)), k + 1, next_backward))
        for k in range(self.num_steady):
            forward_k = k + self.num_warmup
            step = Step(forward=forward_k, backward=k, send_forward=self._sends_forward(forward_k),
                        send_backward=self._sends_backward(k))
            steps.append(self._exchange(step, forward_k + 1, k + 1))
        if not self.forward_only:
            for k in range(self.num_steady, self.total):
                steps.append(self._exchange(Step(backward=k, send_backward=self._sends_backward(k)), None, k + 1))
        return [step for step in steps if step != Step()]

    def _exchange(self, step, next_forward, next_backward):
        """`step` with the receives for forward `next_forward` and backward `next_backward` (None: none)."""
        recv_forward_chunk = recv_backward_chunk = None
        if next_forward is not None and self._needs_input(next_forward):
            recv_forward_chunk = self.forward_of(next_forward)[1]
        if next_backward is not None and self._needs_output_grad(next_backward):
            recv_backward_chunk = self.backward_of(next_backward)[1]
        return dataclasses.replace(step, recv_forward_chunk=recv_forward_chunk, recv_backward_chunk=recv_backward_chunk)

    def compute_order(self):
        """The forwards and backwards in execution order, as "F<microbatch><chunk>" / "B<microbatch><chunk>"."""
        order = []
        for step in self.steps:
            if step.forward is not None:
                order.append("F{}{}".format(*self.forward_of(step.forward)))
            if step.backward is not None:
                order.append("B{}{}".format(*self.backward_of(step.backward)))
        return order

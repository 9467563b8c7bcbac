"""`RerunDataIterator` keeps the batches of the step being validated only: under `--rerun-mode disabled`, or
drawn outside any step (an evaluation iterator wrapped as upstream wraps its iterators), it holds none."""

from megatron.core import rerun_state_machine as rsm
from megatron.core.rerun_data_iterator import RerunDataIterator


def _steps(machine, data, steps, microbatches):
    for _ in range(steps):
        while machine.should_run_forward_backward(data):
            for _ in range(microbatches):
                next(data)


def test_disabled_mode_and_evaluation_keep_no_batch():
    data = RerunDataIterator(iter(range(100)))
    _steps(rsm.RerunStateMachine(rsm.RerunMode.DISABLED), data, steps=5, microbatches=2)
    assert data.recorded_batch_count() == 0
    machine = rsm.RerunStateMachine(rsm.RerunMode.VALIDATE_RESULTS)
    _steps(machine, data, steps=1, microbatches=2)
    assert data.recorded_batch_count() == 2
    machine.set_mode(rsm.RerunMode.DISABLED)  # reruns turned off between steps
    _steps(machine, data, steps=3, microbatches=2)
    assert data.recorded_batch_count() == 0
    evaluation = RerunDataIterator(iter(range(100)))
    assert [next(evaluation) for _ in range(7)] == list(range(7))
    assert evaluation.recorded_batch_count() == 0


def test_validate_results_keeps_the_current_step_and_replays_it():
    data = RerunDataIterator(iter(range(100)))
    _steps(rsm.RerunStateMachine(rsm.RerunMode.VALIDATE_RESULTS), data, steps=3, microbatches=2)
    assert data.recorded_batch_count() == 2  # the last step's batches, the earlier ones forgotten
    data.rewind()
    assert [next(data) for _ in range(3)] == [4, 5, 6]

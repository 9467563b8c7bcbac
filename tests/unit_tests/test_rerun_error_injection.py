"""The rerun state machine's fault injection (--error-injection-rate / --error-injection-type) drives the exit-16
and exit-17 paths; --result-rejected-tracker-filename records each rejection and its verdict; the large-gradient
check (--check-for-large-grads) rejects a norm 10x the first ones, not fatally. In `pretrain()`, an injected
transient error stops the run with 17 and leaves its trace in the tracker file."""

import argparse
import contextlib
import io
import math
import random

import pytest
import torch

from megatron.core import rerun_state_machine as rsm
from megatron.core.rerun_data_iterator import RerunDataIterator
from tests.unit_tests.multiprocess_harness import run_on_ranks

MESSAGE = "found NaN in local forward loss calculation"


def _iteration(machine, data):
    """One step validating a healthy, deterministic result (the batch's value); returns the runs' batches."""
    batches = []
    while machine.should_run_forward_backward(data):
        batches.append(next(data))
        machine.validate_result(float(batches[-1]), math.isnan, MESSAGE)
    return batches


@pytest.mark.parametrize("injected, exit_code, resumed_elsewhere", [
    ("transient_error", 17, None),
    ("correct_result", 16, rsm.RerunDiagnostic.CORRECT_RESULT),
    ("persistent_error", 16, rsm.RerunDiagnostic.PERSISTENT_ERROR),
])
def test_injected_fault_behaves_like_its_kind(injected, exit_code, resumed_elsewhere, tmp_path, monkeypatch):
    tracker = tmp_path / "rejected.txt"
    machine = rsm.RerunStateMachine(rsm.RerunMode.VALIDATE_RESULTS, error_injection_rate=1,
                                    error_injection_type=injected, result_rejected_tracker_filename=str(tracker))
    data = RerunDataIterator(iter(range(100)))
    assert _iteration(machine, data) == [0, 0]  # a healthy result rejected by injection, rerun on the same batch
    assert machine.should_checkpoint_and_exit() == (True, True, exit_code)
    lines = [line.split("\t") for line in tracker.read_text().splitlines()]
    assert [fields[1] for fields in lines] == ["iteration=1", "iteration=1"]
    assert lines[0][5:] == ["rejected", "result=0.0", f"injected={injected}", f"message={MESSAGE}"]
    assert lines[1][5] == "verdict" and lines[1][-1] == f"exit={exit_code}"
    if resumed_elsewhere is None:
        assert lines[1][6:8] == ["did not reproduce in place", "diagnostic=transient_error"]
        return
    # Resumed from the checkpoint on another node: the injected kind decides whether the result matches.
    state = machine.state_dict()
    assert state["injected_error_type"] == injected
    monkeypatch.setattr(rsm, "this_node_and_device", lambda: ("another-node", "cpu"))
    resumed = rsm.RerunStateMachine(rsm.RerunMode.VALIDATE_RESULTS, result_rejected_tracker_filename=str(tracker))
    resumed.load_state_dict(state)
    assert _iteration(resumed, RerunDataIterator(iter(range(100)))) == [0]
    assert resumed.diagnostic == resumed_elsewhere
    assert resumed.should_checkpoint_and_exit() == (False, True, 17)
    assert tracker.read_text().splitlines()[-1].endswith(f"diagnostic={resumed_elsewhere.value}\texit=17")


def test_injection_rate_draws_from_its_own_generator():
    machine = rsm.RerunStateMachine(rsm.RerunMode.VALIDATE_RESULTS, error_injection_rate=4)
    data = RerunDataIterator(iter(range(1000)))
    random.seed(0)
    expected_python = random.random()
    random.seed(0)
    rejected = 0
    for _ in range(200):
        rejected += len(_iteration(machine, data)) == 2
        machine.state = rsm.RerunState.NOT_RUNNING_YET  # go on after an injected (transient) fault
    assert random.random() == expected_python  # the training step's Python generator is untouched
    assert 25 <= rejected <= 75  # about 1 in 4 steps


def test_large_gradients_are_rejected_not_fatally(monkeypatch):
    from megatron.training.result_validation import validate_gradients

    # 100 reference steps: no random state to keep for these reruns, skip its snapshots.
    monkeypatch.setattr(rsm, "capture_random_state", lambda: None)
    monkeypatch.setattr(rsm, "restore_random_state", lambda state: None)

    args = argparse.Namespace(check_for_nan_in_loss_and_grad=False, check_for_large_grads=True)
    layer = torch.nn.Linear(2, 1, bias=False)
    machine = rsm.initialize_rerun_state_machine(rsm.RerunMode.VALIDATE_RESULTS)
    try:
        data = RerunDataIterator(iter(range(1000)))
        # Iteration 1 is not checked; iterations 2..101 give the reference (norms up to 5).
        for iteration in range(1, 102):
            assert machine.should_run_forward_backward(data)
            layer.weight.grad = torch.tensor([[3.0, 4.0]]) * (1.0 if iteration % 2 else 0.5)
            validate_gradients([layer], args)
            assert not machine.should_run_forward_backward(data)
        assert machine.max_values == {"grads": 5.0}
        machine.should_run_forward_backward(data)
        layer.weight.grad = torch.tensor([[30.0, 40.0]])  # norm 50 = 10x the largest
        validate_gradients([layer], args)
        assert machine.rerun_requested
        assert machine.failed_call == ("found unexpectedly large local grad norm", 0)
        assert machine.should_run_forward_backward(data)  # rerun in place; the same norm reproduces
        validate_gradients([layer], args)
        assert not machine.should_run_forward_backward(data)
        assert machine.should_checkpoint_and_exit() == (True, True, 16)
    finally:
        rsm.destroy_rerun_state_machine()


TINY_GPT = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 4 --lr 1e-3 --mock-data --vocab-size 127 --make-vocab-size-divisible-by 64 "
    "--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --log-interval 1 --eval-iters 0 --ckpt-format torch "
    "--train-iters 3"
)


def _pretrain_with_injected_transient_error(workdir):
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    argv = (f"{TINY_GPT} --error-injection-rate 1 --error-injection-type transient_error "
            f"--result-rejected-tracker-filename {workdir}/rejected.txt").split()
    stdout, exit_code = io.StringIO(), None
    try:
        with contextlib.redirect_stdout(stdout):
            pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                     ModelType.encoder_or_decoder, pretrain_gpt.forward_step, argv=argv)
    except SystemExit as stop:
        exit_code = stop.code
    return exit_code, stdout.getvalue()


def test_pretrain_with_an_injected_transient_error_exits_17(tmp_path):
    [(exit_code, stdout)] = run_on_ranks(1, _pretrain_with_injected_transient_error, str(tmp_path))
    assert exit_code == 17
    assert "exiting at iteration 0 with code 17" in stdout
    lines = (tmp_path / "rejected.txt").read_text().splitlines()
    assert len(lines) == 2
    assert "\titeration=1\trank=0\t" in lines[0] and "\tinjected=transient_error\t" in lines[0]
    assert lines[1].endswith("diagnostic=transient_error\texit=17")


def test_injected_fault_rerun_says_why_an_equal_value_counts_as_different(caplog):
    machine = rsm.RerunStateMachine(rsm.RerunMode.VALIDATE_RESULTS, error_injection_rate=1,
                                    error_injection_type="transient_error")
    with caplog.at_level("ERROR", logger=rsm.__name__):
        _iteration(machine, RerunDataIterator(iter(range(10))))
    (rerun_message,) = [record.getMessage() for record in caplog.records if "the rerun gave" in record.getMessage()]
    assert rerun_message == ("rank 0, iteration 1: the rerun gave 0.0 instead of 0.0 (taken as different: the fault "
                             "was injected by --error-injection-type transient_error, which does not reproduce here): "
                             "possible transient fault")

"""The rerun state machine: transient and persistent faults told apart by a rerun on the same data and random
state, the resume that judges a reproduced result, spiky-loss detection, disabled and report_stats modes; and
in `pretrain()` on 2 ranks, a NaN loss on one rank stops every rank in the same iteration with upstream's exit
code, before the optimizer step, leaving the previous iteration's checkpoint as the latest."""

import contextlib
import io
import math
import os

import pytest
import torch

from megatron.core import rerun_state_machine as rsm
from megatron.core.rerun_data_iterator import RerunDataIterator
from tests.unit_tests.multiprocess_harness import run_on_ranks

NAN_MESSAGE = "found NaN in local forward loss calculation"


def _run_iteration(machine, data, results, fatal=True):
    """One training iteration through the machine. `results(run_index, batch, noise)` gives the value to validate
    in each run. Returns what every run drew: (batch, random noise)."""
    draws = []
    while machine.should_run_forward_backward(data):
        batch = next(data)
        noise = torch.rand(3)
        draws.append((batch, noise))
        machine.validate_result(results(len(draws) - 1, batch, noise), math.isnan, NAN_MESSAGE, fatal=fatal)
    return draws


def test_transient_fault_reruns_on_the_same_data_and_random_state_then_exits_17():
    machine = rsm.RerunStateMachine(rsm.RerunMode.VALIDATE_RESULTS)
    data = RerunDataIterator(iter(range(100)))
    # Outside a training step (evaluation) a rejected result is only logged.
    machine.validate_result(math.nan, math.isnan, NAN_MESSAGE)
    assert not machine.rerun_requested and machine.state == rsm.RerunState.NOT_RUNNING_YET
    torch.manual_seed(0)
    assert len(_run_iteration(machine, data, lambda run, batch, noise: float(batch))) == 1
    assert machine.should_checkpoint_and_exit() == (False, False, 0)

    draws = _run_iteration(machine, data, lambda run, batch, noise: math.nan if run == 0 else float(batch))
    (first_batch, first_noise), (second_batch, second_noise) = draws
    assert first_batch == second_batch == 1  # the batch of iteration 2, replayed
    assert torch.equal(first_noise, second_noise)  # the random state restored before the rerun
    assert machine.diagnostic == rsm.RerunDiagnostic.TRANSIENT_ERROR
    assert machine.should_checkpoint_and_exit() == (True, True, rsm.EXIT_CODE_FAILED_ON_RESULT_VALIDATION) == (
        True, True, 17)


def _persistent_fault_checkpoint():
    machine = rsm.RerunStateMachine(rsm.RerunMode.VALIDATE_RESULTS)
    data = RerunDataIterator(iter(range(100)))
    _run_iteration(machine, data, lambda run, batch, noise: 1.0)
    torch.manual_seed(5)
    expected_noise = torch.rand(3)
    torch.manual_seed(5)
    draws = _run_iteration(machine, data, lambda run, batch, noise: math.nan)
    assert len(draws) == 2 and draws[0][0] == draws[1][0] == 1
    assert machine.state == rsm.RerunState.WILL_RERUN_FROM_CHECKPOINT
    # The random state is back where the iteration started: the checkpoint saves the state before the step.
    assert torch.equal(torch.rand(3), expected_noise)
    assert machine.should_checkpoint_and_exit() == (True, True, rsm.EXIT_CODE_RESUME_TO_DISAMBIGUATE) == (
        True, True, 16)
    state = machine.state_dict()
    # Upstream's checkpoint code passes the data iterator and the checkpoint format.
    assert machine.state_dict(data_iterator=data, ckpt_format="torch_dist") == state
    return state


@pytest.mark.parametrize(
    "resumed_on, rerun_result, fatal, expected",
    [
        ("same device", math.nan, True, (False, True, 16)),
        ("other device", 2.0, True, (False, True, 17)),  # a different result: persistent fault
        ("other device", math.nan, True, (False, True, 17)),  # the same result: correct, fatal check
        ("other device", math.nan, False, (False, False, 0)),  # the same result, non-fatal check: continue
    ],
)
def test_reproduced_result_is_judged_after_resuming_elsewhere(monkeypatch, resumed_on, rerun_result, fatal,
                                                               expected):
    state = _persistent_fault_checkpoint()
    assert state["failed_call"] == (NAN_MESSAGE, 0) and math.isnan(state["initial_result"])
    if resumed_on == "other device":
        monkeypatch.setattr(rsm, "this_node_and_device", lambda: ("another-node", "cpu"))
    resumed = rsm.RerunStateMachine(rsm.RerunMode.VALIDATE_RESULTS)
    resumed.current_iteration = 1  # the checkpoint's iteration
    resumed.load_state_dict(state)
    draws = _run_iteration(resumed, RerunDataIterator(iter(range(1, 100))), lambda *_: rerun_result, fatal=fatal)
    assert [batch for batch, _ in draws] == [1] and resumed.current_iteration == 2
    assert resumed.should_checkpoint_and_exit() == expected
    diagnostics = {2.0: rsm.RerunDiagnostic.PERSISTENT_ERROR}
    if resumed_on == "other device":
        assert resumed.diagnostic == diagnostics.get(rerun_result, rsm.RerunDiagnostic.CORRECT_RESULT)


def test_spiky_loss_against_a_hand_built_sequence():
    machine = rsm.RerunStateMachine()
    # (iteration, loss, rejected): iteration 1 is skipped; 3 samples build the reference maximum (2.5); then a
    # loss is rejected from 10 x 2.5 = 25 on; NaN and Inf are left to their own checks.
    sequence = [(1, 100.0, False), (2, 2.0, False), (3, -2.5, False), (4, 1.0, False), (5, 24.9, False),
                (6, 25.0, True), (7, -30.0, True), (8, math.nan, False), (9, math.inf, False), (10, 3.0, False)]
    for iteration, loss, rejected in sequence:
        machine.current_iteration = iteration
        assert machine.is_unexpectedly_large(torch.tensor(loss), 10.0, "loss", num_samples=3) is rejected, iteration
    assert machine.max_values["loss"] == 2.5
    assert machine.is_unexpectedly_large(torch.tensor(30.0), 10.0, "grads", num_samples=3) is False  # own context


def test_disabled_mode_runs_once_without_rerun_or_random_state_restore():
    machine = rsm.RerunStateMachine(rsm.RerunMode.DISABLED)
    data = iter(range(100))  # no RerunDataIterator needed: nothing is replayed
    draws = _run_iteration(machine, data, lambda run, batch, noise: math.nan, fatal=False)
    assert len(draws) == 1 and machine.should_checkpoint_and_exit() == (False, False, 0)
    assert machine.state == rsm.RerunState.NOT_RUNNING_YET and machine.saved_results == {}
    with pytest.raises(RuntimeError, match=r"iteration 2: unexpected result nan \(found NaN"):
        _run_iteration(machine, data, lambda run, batch, noise: math.nan, fatal=True)
    assert machine.should_checkpoint_and_exit() == (False, False, 0)


def test_report_stats_runs_every_iteration_twice_and_records_differences(capsys):
    machine = rsm.RerunStateMachine(rsm.RerunMode.REPORT_STATS, report_interval=2)
    data = RerunDataIterator(iter(range(100)))
    values = iter([1.0, 1.0, 2.0, 2.2])  # iteration 1 reproduces exactly, iteration 2 differs by 2(0.2)/4.2
    for _ in range(2):
        assert len(_run_iteration(machine, data, lambda *_: next(values))) == 2
        assert machine.should_checkpoint_and_exit() == (False, False, 0)
    stats = machine.stats[NAN_MESSAGE]
    assert (stats.count, stats.nonzero) == (2, 1)
    assert stats.largest == pytest.approx(0.4 / 4.2, rel=1e-12)
    assert f"{NAN_MESSAGE}: 2 reruns, 1 differed" in capsys.readouterr().out


def test_relative_difference():
    assert rsm.relative_difference(2.0, 2.2) == pytest.approx(0.4 / 4.2, rel=1e-12)
    assert rsm.relative_difference(math.nan, math.nan) == 0.0
    assert rsm.relative_difference(math.nan, 1.0) == math.inf


# ---------------------------------------------------------------------------------------------------------
# pretrain() on 2 ranks with a NaN injected into one rank's loss
# ---------------------------------------------------------------------------------------------------------

TINY_GPT = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 8 --lr 1e-3 --mock-data --vocab-size 127 --make-vocab-size-divisible-by 64 "
    "--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --log-interval 1 --eval-iters 0 --ckpt-format torch "
    "--train-iters 4 --save-interval 2"
)
BAD_ITERATION = 3


def _pretrain_with_nan_on_rank_1(workdir, fault, load):
    """Train with rank 1's output (hence loss) NaN in iteration 3: in its first run only (transient) or in every
    run (persistent). Returns what each rank saw when training stopped."""
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    rank = torch.distributed.get_rank()
    runs_of_bad_iteration = {"count": 0}

    def forward_step_with_fault(data_iterator, model):
        machine = rsm.get_rerun_state_machine()
        runs_of_bad_iteration["count"] += machine.current_iteration == BAD_ITERATION
        output, loss_func = pretrain_gpt.forward_step(data_iterator, model)
        first_run = machine.state in (rsm.RerunState.INITIAL_RUN, rsm.RerunState.RERUNNING_FROM_CHECKPOINT)
        if rank == 1 and machine.current_iteration == BAD_ITERATION and (fault == "persistent" or first_run):
            output = output * math.nan
        return output, loss_func

    argv = f"{TINY_GPT} --save {workdir}" + (f" --load {workdir}" if load else "")
    stdout, exit_code = io.StringIO(), None
    try:
        with contextlib.redirect_stdout(stdout):
            pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                     ModelType.encoder_or_decoder, forward_step_with_fault, argv=argv.split())
    except SystemExit as stop:
        exit_code = stop.code
    # Microbatches per rank and run: 8 / (2 x 2 data-parallel ranks).
    return {"exit_code": exit_code, "runs_of_bad_iteration": runs_of_bad_iteration["count"] / 2,
            "stdout": stdout.getvalue()}


def _checkpoint(workdir, iteration):
    from megatron.training.checkpointing import read_tracker

    state = torch.load(os.path.join(workdir, f"iter_{iteration:07d}", "mp_rank_00", "model_optim_rng.pt"),
                       weights_only=False)
    return read_tracker(workdir), state["model"]


@pytest.mark.parametrize("world_size", [2])
def test_nan_on_one_rank_transient_fault_exits_17_on_every_rank(tmp_path, world_size):
    results = run_on_ranks(world_size, _pretrain_with_nan_on_rank_1, str(tmp_path), "transient", False)
    # Both ranks ran iteration 3 twice (the rerun), then stopped with 17.
    assert [(result["exit_code"], result["runs_of_bad_iteration"]) for result in results] == [(17, 2), (17, 2)]
    # Iterations 1 and 2 were logged (on the last rank); iteration 3 never completed on any rank.
    logged = [line for line in results[1]["stdout"].splitlines() if line.startswith("iteration ")]
    assert [line.split("/")[0] for line in logged] == ["iteration 1", "iteration 2"]
    assert "exiting at iteration 2 with code 17" in results[0]["stdout"]
    tracker, weights = _checkpoint(tmp_path, 2)
    assert tracker == 2 and sorted(name for name in os.listdir(tmp_path) if name.startswith("iter_")) == [
        "iter_0000002"]
    assert all(torch.isfinite(tensor).all() for tensor in weights.values() if torch.is_tensor(tensor))
    assert not any(name.startswith("rerun_state") for name in os.listdir(tmp_path / "iter_0000002"))


@pytest.mark.parametrize("world_size", [2])
def test_nan_on_one_rank_persistent_fault_saves_state_exits_16_and_again_when_resumed_on_the_same_node(
        tmp_path, world_size):
    results = run_on_ranks(world_size, _pretrain_with_nan_on_rank_1, str(tmp_path), "persistent", False)
    assert [(result["exit_code"], result["runs_of_bad_iteration"]) for result in results] == [(16, 2), (16, 2)]
    tracker, weights = _checkpoint(tmp_path, 2)
    assert tracker == 2 and not (tmp_path / "iter_0000003").exists()
    assert all(torch.isfinite(tensor).all() for tensor in weights.values() if torch.is_tensor(tensor))
    rerun_states = [torch.load(tmp_path / "iter_0000002" / f"rerun_state_rank_0000{rank}.pt") for rank in (0, 1)]
    # Rank 1's loss was NaN; rank 0 received the NaN through the gradient all-reduce: its gradient norm check failed.
    assert rerun_states[0]["failed_call"] == ("found NaN in local grad norm", 0)
    assert rerun_states[1]["failed_call"] == (NAN_MESSAGE, 0) and math.isnan(rerun_states[1]["initial_result"])

    # Resumed on the same node and device: the result cannot be judged there, exit 16 again, nothing new saved.
    resumed = run_on_ranks(world_size, _pretrain_with_nan_on_rank_1, str(tmp_path), "persistent", True)
    assert [(result["exit_code"], result["runs_of_bad_iteration"]) for result in resumed] == [(16, 1), (16, 1)]
    assert "asks to rerun iteration 3" in resumed[0]["stdout"]
    assert _checkpoint(tmp_path, 2)[0] == 2 and not (tmp_path / "iter_0000003").exists()


def test_loss_and_gradient_checks_follow_the_flags():
    import argparse

    import pretrain_gpt
    from megatron.training.result_validation import local_grad_norm, validate_gradients

    layer = torch.nn.Linear(2, 1, bias=False)
    layer.weight.grad = torch.tensor([[3.0, 4.0]])
    assert local_grad_norm([layer]).item() == 5.0

    def machine_after(check, flags):
        machine = rsm.initialize_rerun_state_machine(rsm.RerunMode.VALIDATE_RESULTS)
        machine.should_run_forward_backward(None)
        check(argparse.Namespace(**flags))
        return machine

    try:
        off = {"check_for_nan_in_loss_and_grad": False, "check_for_spiky_loss": False}
        on = {"check_for_nan_in_loss_and_grad": True, "check_for_spiky_loss": False}
        # --no-check-for-nan-in-loss-and-grad: a NaN loss or gradient goes unchecked.
        nan_loss = lambda args: pretrain_gpt.validate_loss(torch.tensor(math.nan), args)  # noqa: E731
        assert not machine_after(nan_loss, off).rerun_requested
        layer.weight.grad = torch.tensor([[3.0, math.inf]])
        assert not machine_after(lambda args: validate_gradients([layer], args), off).rerun_requested
        # Checked by default: the first rejected check is the one a rerun compares.
        machine = machine_after(lambda args: validate_gradients([layer], args), on)
        assert machine.rerun_requested and machine.failed_call == ("found Inf in local grad norm", 0)
        machine = machine_after(lambda args: pretrain_gpt.validate_loss(torch.tensor(-math.inf), args), on)
        assert machine.failed_call == ("found Inf in local forward loss calculation", 0)
        # --check-for-spiky-loss hands the loss to is_unexpectedly_large under the context "loss".
        machine = machine_after(lambda args: None, on)
        machine.current_iteration = 2
        pretrain_gpt.validate_loss(torch.tensor(1.5), argparse.Namespace(**{**on, "check_for_spiky_loss": True}))
        assert machine.large_value_counts == {"loss": 1} and machine.max_values == {"loss": 1.5}
    finally:
        rsm.destroy_rerun_state_machine()


def test_upstream_name_of_the_report_stats_mode():
    assert rsm.RerunMode.REPORT_DETERMINISM_STATS is rsm.RerunMode.REPORT_STATS is rsm.RerunMode("report_stats")


def test_a_result_found_correct_is_forgotten_by_the_next_step(monkeypatch, tmp_path):
    """A non-fatal rejected result, found correct on another device, lets training go on; when another rank then
    rejects a result, this rank must neither judge its healthy result against the old one nor save it again."""
    state = _persistent_fault_checkpoint()
    monkeypatch.setattr(rsm, "this_node_and_device", lambda: ("another-node", "cpu"))
    tracker = tmp_path / "rejected.txt"
    resumed = rsm.RerunStateMachine(rsm.RerunMode.VALIDATE_RESULTS, result_rejected_tracker_filename=str(tracker))
    resumed.load_state_dict(state)
    data = RerunDataIterator(iter(range(1, 100)))
    _run_iteration(resumed, data, lambda *_: math.nan, fatal=False)
    assert resumed.should_checkpoint_and_exit() == (False, False, 0)
    tracked = tracker.read_text()
    assert tracked.splitlines()[-1].endswith("\tverdict\trerun on another node or device\tdiagnostic=correct_result\t"
                                             "training continues")

    monkeypatch.setattr(resumed, "_any_rank", lambda flag: True)  # another rank rejects a result, reproducibly
    assert len(_run_iteration(resumed, data, lambda run, batch, noise: float(batch))) == 2
    assert resumed.state_dict()["failed_call"] is None and resumed.state_dict()["initial_result"] is None
    assert resumed.should_checkpoint_and_exit() == (True, True, 16)
    assert tracker.read_text() == tracked  # nothing rejected on this rank


def test_implicit_machine_is_disabled_as_upstream_and_warns_once(caplog):
    """A loop of its own that never initialized the machine gets upstream's: disabled (a rejected fatal result
    raises, no rerun), created with a warning the first time only."""
    rsm.destroy_rerun_state_machine()
    try:
        with caplog.at_level("WARNING", logger=rsm.__name__):
            machine = rsm.get_rerun_state_machine()
            assert rsm.get_rerun_state_machine() is machine
        implicit = [record for record in caplog.records if "Implicit initialization" in record.getMessage()]
        assert [record.getMessage() for record in implicit] == ["Implicit initialization of Rerun State Machine!"]
        assert machine.get_mode() == rsm.RerunMode.DISABLED
        data = RerunDataIterator(iter(range(100)))
        with pytest.raises(RuntimeError, match=r"iteration 1: unexpected result nan \(found NaN"):
            _run_iteration(machine, data, lambda *_: math.nan)
        assert machine.should_checkpoint_and_exit() == (False, False, 0)
    finally:
        rsm.destroy_rerun_state_machine()


def test_upstream_initialization_keywords_restore_the_callers_state_before_a_rerun():
    """Upstream's `initialize_rerun_state_machine(state_save_func=, state_restore_func=, mode=,
    error_injector=RerunErrorInjector(rate, type), result_rejected_tracker_filename=)`: the caller's state is saved
    before the step and restored before its rerun, as the random state is."""
    counter = {"value": 0}
    saved = []

    def state_save_func():
        saved.append(counter["value"])
        return {"counter": counter["value"]}

    def state_restore_func(state):
        counter["value"] = state["counter"]

    machine = rsm.initialize_rerun_state_machine(
        state_save_func=state_save_func,
        state_restore_func=state_restore_func,
        mode=rsm.RerunMode.VALIDATE_RESULTS,
        error_injector=rsm.RerunErrorInjector(error_injection_rate=1,
                                              error_injection_type=rsm.RerunDiagnostic.TRANSIENT_ERROR),
        result_rejected_tracker_filename=None,
    )
    try:
        assert rsm.get_rerun_state_machine() is machine
        assert (machine.error_injection_rate, machine.error_injection_type) == (1, rsm.RerunDiagnostic.TRANSIENT_ERROR)
        seen = []
        data = RerunDataIterator(iter(range(100)))
        while machine.should_run_forward_backward(data):
            counter["value"] += 10  # the step moves the caller's state
            seen.append(counter["value"])
            machine.validate_result(float(next(data)), math.isnan, NAN_MESSAGE)
        # Injected (rate 1): rerun in place from the saved state, the same value again; transient: exit 17.
        assert saved == [0] and seen == [10, 10]
        assert machine.should_checkpoint_and_exit() == (True, True, 17)
    finally:
        rsm.destroy_rerun_state_machine()


def test_upstream_initialization_keywords_refuse_what_cannot_work():
    with pytest.raises(ValueError, match="state_save_func and state_restore_func go together"):
        rsm.RerunStateMachine(rsm.RerunMode.VALIDATE_RESULTS, state_save_func=dict)
    with pytest.raises(ValueError, match="either as error_injector=RerunErrorInjector"):
        rsm.RerunStateMachine(error_injector=rsm.RerunErrorInjector(2), error_injection_rate=3)
    with pytest.raises(ValueError, match=r"error_injection_type \(--error-injection-type\) must be one of"):
        rsm.RerunErrorInjector(1, "bogus")
    with pytest.raises(ValueError, match=r"error_injection_rate \(--error-injection-rate\) must be an integer >= 0"):
        rsm.RerunErrorInjector(-1)
    with pytest.raises(TypeError, match="pass state_save_func and state_restore_func by keyword"):
        rsm.RerunStateMachine(dict, dict)
    injector = rsm.RerunErrorInjector()
    assert (injector.error_injection_rate, injector.error_injection_type, injector.should_inject_errors) == (
        0, rsm.RerunDiagnostic.TRANSIENT_ERROR, False)

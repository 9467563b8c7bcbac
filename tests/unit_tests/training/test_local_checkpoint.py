"""`--non-persistent-ckpt-type local` on real `pretrain()` runs at 2 ranks, and its pure parts.

Per wrapper, one pool task trains 8 iterations straight; then a run saves a persistent checkpoint at 2, a run
resumes it with local checkpoints every 2 iterations and stops at 6 (no persistent save: no --save), and the
same command resumes the local checkpoint of 6 and trains to 8: its losses equal the straight run's bit for bit
(fp32 on CPU). Under DDP, copies of the local checkpoint of 6 are then loaded without --load, under another
layout (refused, the global checkpoint of 2 is loaded) and with one rank's part left as an interrupted `.tmp`
(refused, likewise).
"""

import contextlib
import io
import os
import shutil

import pytest
import torch

from megatron.training import local_checkpoint_files
from megatron.training.local_checkpoint import layout_difference, newest_common_iteration
from megatron.training.local_checkpoint_pieces import PieceId, assign_owners, exchange_plan
from tests.unit_tests.dist_checkpointing.pretrain_helpers import run_pretrain
from tests.unit_tests.multiprocess_harness import run_on_ranks

WORLD_SIZE = 2
SCHEDULE = "--train-iters 8 --lr-decay-iters 8"
WRAPPERS = {
    "ddp": "",
    "distopt_atomic": "--use-distributed-optimizer",  # saved with --non-persistent-local-ckpt-algo atomic
    # Local saves written in the background (--async-save), published at a later iteration or before the exit.
    "mfsdp_z3_async": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
    "fsdp2": "--use-torch-fsdp2",
    # The last stage's output-layer copy of the tied embedding (and its optimizer state) is in its own part.
    "tied_pp2": "TIED --use-distributed-optimizer --pipeline-model-parallel-size 2",
}


def _local(directory, wrapper="ddp"):
    algorithm = "atomic" if wrapper.endswith("_atomic") else "fully_parallel"
    background = " --async-save" if wrapper.endswith("_async") else ""
    return (f"--non-persistent-ckpt-type local --non-persistent-local-ckpt-dir {directory} "
            f"--non-persistent-local-ckpt-algo {algorithm} --non-persistent-save-interval 2 --exit-interval 6"
            f"{background}")


def _run(workdir, extra_args):
    """(losses, what rank 0 printed)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        losses = run_pretrain(workdir, extra_args)
    return losses, printed.getvalue()


def _listing(root):
    return {rank_dir: sorted(os.listdir(os.path.join(root, rank_dir))) for rank_dir in sorted(os.listdir(root))}


def _copy(source, destination):
    if torch.distributed.get_rank() == 0:
        shutil.copytree(source, destination)
    torch.distributed.barrier()


def _all_runs(workdir, wrapper):
    flags = f"{SCHEDULE} {WRAPPERS[wrapper]}"
    persistent, local = f"{workdir}/persistent", f"{workdir}/local"
    results = {"straight": run_pretrain(workdir, flags)}
    run_pretrain(workdir, f"{flags} --save {persistent} --save-interval 2 --exit-interval 2")
    results["interrupted"] = _run(workdir, f"{flags} --load {persistent} {_local(local, wrapper)}")[0]
    results["listing_at_6"] = _listing(local)
    for copy in ("no_load", "tp2", "incomplete"):
        _copy(local, f"{workdir}/{copy}")
    results["resumed"], results["resumed_log"] = _run(workdir, f"{flags} --load {persistent} "
                                                               f"{_local(local, wrapper)}")
    results["listing_at_8"] = _listing(local)
    if wrapper != "ddp":
        return results
    results["no_load"], results["no_load_log"] = _run(workdir, f"{flags} {_local(workdir + '/no_load')}")
    results["tp2"], results["tp2_log"] = _run(
        workdir, f"{SCHEDULE} --tensor-model-parallel-size 2 --load {persistent} {_local(workdir + '/tp2')}")
    if torch.distributed.get_rank() == 0:  # rank 1's save of iteration 6 interrupted before its rename
        part = local_checkpoint_files.checkpoint_dir(f"{workdir}/incomplete", 1, 6)
        os.rename(part, part + ".tmp")
    torch.distributed.barrier()
    results["incomplete"], results["incomplete_log"] = _run(
        workdir, f"{flags} --load {persistent} {_local(workdir + '/incomplete')}")
    return results


@pytest.fixture(scope="module", params=list(WRAPPERS))
def runs(request, tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp(f"local_checkpoint_{request.param}"))
    return request.param, workdir, run_on_ranks(WORLD_SIZE, _all_runs, workdir, request.param)[0]


def _from(losses, first, last=8):
    return {iteration: losses[iteration] for iteration in range(first, last + 1)}


def test_resume_from_the_local_checkpoint_is_exact(runs):
    wrapper, _, results = runs
    straight = results["straight"]
    assert sorted(straight) == list(range(1, 9)) and len(set(straight.values())) == 8
    assert results["interrupted"] == _from(straight, 3, 6)  # resumed the persistent checkpoint of 2
    assert results["resumed"] == _from(straight, 7)  # resumed the local checkpoint of 6
    assert "loaded local checkpoint" in results["resumed_log"]
    assert "newer than the global checkpoint: of iteration 2" in results["resumed_log"]
    written = "saved local checkpoint of iteration 8 to "
    if wrapper.endswith("_async"):
        assert written in results["resumed_log"] and "in the background" in results["resumed_log"]
    else:
        assert written in results["resumed_log"] and "in the background" not in results["resumed_log"]


def test_only_the_latest_local_checkpoint_is_kept(runs):
    _, _, results = runs
    assert results["listing_at_6"] == {"rank_00000": ["iter_0000006"], "rank_00001": ["iter_0000006"]}
    assert results["listing_at_8"] == {"rank_00000": ["iter_0000008"], "rank_00001": ["iter_0000008"]}


def test_parts_store_replicas_once_with_fully_parallel_and_everything_with_atomic(runs):
    wrapper, workdir, _ = runs
    parts = [local_checkpoint_files.read_state(local_checkpoint_files.checkpoint_dir(f"{workdir}/local", rank, 8))
             for rank in range(WORLD_SIZE)]
    stored = [set(part["tensors"]) for part in parts]
    held = [set(part["held"]) for part in parts]
    if wrapper == "distopt_atomic":
        assert stored == held and not any(part["exchange_plan"] for part in parts)
        return
    replicated = held[0] & held[1]
    assert not stored[0] & stored[1]  # nothing written twice
    assert stored[0] | stored[1] == held[0] | held[1]
    if wrapper == "ddp":  # data-parallel replicas: everything; each rank writes a share
        assert held[0] == held[1] == replicated and stored[0] and stored[1]
    assert {PieceId(*piece) for piece, _ in parts[0]["exchange_plan"]} == replicated


@pytest.mark.parametrize("runs", ["ddp"], indirect=True)
def test_local_checkpoint_is_resumed_without_load(runs):
    _, _, results = runs
    assert results["no_load"] == _from(results["straight"], 7)
    assert "newer than the global checkpoint: none" in results["no_load_log"]


@pytest.mark.parametrize("runs", ["ddp"], indirect=True)
def test_local_checkpoint_of_another_layout_falls_back_to_the_global_one(runs):
    _, _, results = runs
    log = results["tp2_log"]
    assert ("local checkpoint of iteration 6 in " in log and "not used: rank 0 (and 1 other rank(s)): it was written "
            "with data_parallel_size=2" in log and "tensor_model_parallel_size=1" in log
            and "but this run has data_parallel_size=1" in log and "world size that wrote it" in log
            and "loading the global checkpoint under --load" in log)
    # Resumed from the persistent checkpoint of 2, resharded to TP2: the same losses up to reduction order.
    assert sorted(results["tp2"]) == [3, 4, 5, 6]
    for iteration, loss in results["tp2"].items():
        assert loss == pytest.approx(results["straight"][iteration], rel=1e-6, abs=0)


@pytest.mark.parametrize("runs", ["ddp"], indirect=True)
def test_incomplete_local_checkpoint_falls_back_to_the_global_one(runs):
    _, _, results = runs
    assert ("local checkpoint of iteration 6 in " in results["incomplete_log"]
            and "is incomplete: rank(s) [1] have no complete part of it" in results["incomplete_log"])
    assert results["incomplete"] == _from(results["straight"], 3, 6)


def _save_step_perturb_load(root, flags):
    """Save a local checkpoint after 2 steps, take a 3rd, perturb everything (2 more steps, other seeds), load
    it and take the 3rd again: (RNG restored, consumed samples, 3rd step's parameters equal, loaded iteration)."""
    import random

    from megatron.training.checkpointing import maybe_finalize_async_save
    from megatron.training.local_checkpoint import load_local_checkpoint, save_local_checkpoint
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState

    state = TrainingState(f"{flags} --non-persistent-ckpt-type local --non-persistent-local-ckpt-dir {root}")
    try:
        state.train_steps(2)
        state.args.consumed_train_samples = 16
        save_local_checkpoint(2, state.model, state.optimizer, state.scheduler, state.args)
        saved_rng = (torch.get_rng_state(), random.getstate())

        def third_step():
            state.train_steps(1)
            return [param.detach().clone() for chunk in state.model for param in chunk.parameters()]

        reference = third_step()  # with --async-save, while the part of 2 may still be written
        maybe_finalize_async_save(state.args, blocking=True)
        state.train_steps(2)
        torch.manual_seed(9)
        random.seed(9)
        state.args.consumed_train_samples = 0
        iteration = load_local_checkpoint(state.model, state.optimizer, state.scheduler, state.args, None)
        rng_restored = torch.equal(torch.get_rng_state(), saved_rng[0]) and random.getstate() == saved_rng[1]
        consumed = state.args.consumed_train_samples
        same_step = all(torch.equal(a, b) for a, b in zip(third_step(), reference))
        return rng_restored, consumed, same_step, iteration
    finally:
        state.close()


@pytest.mark.parametrize("flags", ["--non-persistent-local-ckpt-algo fully_parallel",
                                   "--use-distributed-optimizer --non-persistent-local-ckpt-algo atomic",
                                   "--use-megatron-fsdp --async-save"])
def test_a_load_restores_model_optimizer_scheduler_rng_and_samples(tmp_path, flags):
    results = run_on_ranks(WORLD_SIZE, _save_step_perturb_load, str(tmp_path), flags)
    assert results == [(True, 16, True, 2)] * WORLD_SIZE


def _save_failing_on_rank_1(root, flags):
    """A local save at 2, then one at 4 whose write fails on rank 1: (rank dir listings, what rank 0 printed)."""
    from unittest import mock

    from megatron.training.checkpointing import maybe_finalize_async_save
    from megatron.training.local_checkpoint import save_local_checkpoint
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState

    state = TrainingState(f"{flags} --non-persistent-ckpt-type local --non-persistent-local-ckpt-dir {root}")
    try:
        state.train_steps(1)
        save_local_checkpoint(2, state.model, state.optimizer, state.scheduler, state.args)
        maybe_finalize_async_save(state.args, blocking=True)
        failing = mock.patch.object(local_checkpoint_files, "write", side_effect=OSError("No space left on device"))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), (failing if torch.distributed.get_rank() == 1 else
                                                   contextlib.nullcontext()):
            save_local_checkpoint(4, state.model, state.optimizer, state.scheduler, state.args)
            maybe_finalize_async_save(state.args, blocking=True)  # with --async-save: the write of 4 has ended
        torch.distributed.barrier()
        return _listing(root), printed.getvalue()
    finally:
        state.close()


@pytest.mark.parametrize("flags", ["", "--async-save"])
def test_a_save_failing_on_one_rank_keeps_the_previous_checkpoint(tmp_path, flags):
    results = run_on_ranks(WORLD_SIZE, _save_failing_on_rank_1, str(tmp_path), flags)
    listing, printed = results[0]
    assert listing == {"rank_00000": ["iter_0000002"], "rank_00001": ["iter_0000002"]}
    kept = "; the previous local checkpoint in"
    if not flags:
        assert ("local checkpoint of iteration 4 was NOT saved: rank(s) [1] could not write their part (OSError: No "
                "space left on device)" + kept in printed)
        return
    assert "local checkpoint of iteration 4 was NOT saved: a background write failed (see above)" + kept in printed
    assert ("rank 1: background write of local checkpoint of iteration 4 to" in results[1][1]
            and "failed: OSError: No space left on device" in results[1][1])


def _resume_under_another_optimizer(root):
    """A local checkpoint saved under Adam, loaded under --optimizer sgd: the error (or None) and the loaded
    iteration (or None), without and with --no-load-optim."""
    from megatron.core.dist_checkpointing.serialization import CheckpointError
    from megatron.training.local_checkpoint import load_local_checkpoint, save_local_checkpoint
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState

    local = f"--non-persistent-ckpt-type local --non-persistent-local-ckpt-dir {root}"
    state = TrainingState(local)
    try:
        state.train_steps(1)
        save_local_checkpoint(2, state.model, state.optimizer, state.scheduler, state.args)
    finally:
        state.close()
    results = []
    for flags in ("--optimizer sgd", "--optimizer sgd --no-load-optim"):
        state = TrainingState(f"{local} {flags}")
        try:
            results.append((None, load_local_checkpoint(state.model, state.optimizer, state.scheduler, state.args,
                                                        None)))
        except CheckpointError as exc:
            results.append((str(exc), None))
        finally:
            state.close()
    return results


def test_a_local_checkpoint_of_another_optimizer_is_refused_as_a_global_one(tmp_path):
    """Adam's moments do not fit SGD: the load stops with the torch_dist load's message (not a quiet fall back to
    the global checkpoint or to a start from scratch), and --no-load-optim loads the rest."""
    results = run_on_ranks(WORLD_SIZE, _resume_under_another_optimizer, str(tmp_path))
    for rank, ((error, _), no_load_optim) in enumerate(results):
        part = local_checkpoint_files.checkpoint_dir(str(tmp_path), rank, 2)
        assert error == (
            f"{part}: the optimizer state was saved with --optimizer adam (two Adam moments), which does not fit "
            "--optimizer sgd (a momentum buffer). Pass --no-load-optim to load the weights and the iteration and start "
            "the optimizer state and the learning-rate schedule afresh, or resume with --optimizer adam.")
        assert no_load_optim == (None, 2)


@pytest.mark.parametrize("runs", ["ddp"], indirect=True)
def test_local_checkpoint_of_another_world_size_is_not_loaded(runs, capsys):
    """This process alone (a world of 1) finds the parts the 2-rank runs wrote: refused before the model is
    touched."""
    import argparse

    from megatron.training.local_checkpoint import load_local_checkpoint

    _, workdir, _ = runs
    args = argparse.Namespace(non_persistent_local_ckpt_dir=f"{workdir}/local", load=None)
    assert load_local_checkpoint(None, None, None, args, None) is None
    assert (f"local checkpoint in {workdir}/local not used: it was written by 2 ranks but this run has 1 (a local "
            "checkpoint loads only under the parallel layout and world size that wrote it); no --load is given: "
            "training starts from scratch") in capsys.readouterr().out


# ---- pure parts -----------------------------------------------------------------------------------------------


def _piece(key, rows):
    return PieceId(key, (0, 0), (rows, 4), "torch.float32")


def test_fully_parallel_stores_each_replica_once_balancing_bytes():
    big, small, other, own = _piece("a", 8), _piece("b", 2), _piece("c", 2), _piece("d", 1)
    held = [[big, small, other, own], [big, small, other], [big, small]]
    owners = assign_owners(held)
    assert owners[own] == 0  # held by one rank only
    assert owners[big] == 1  # the largest first: rank 0 already stores `own`; ranks 1 and 2 tie, the lower wins
    assert owners[small] == 2 and owners[other] == 0  # each to the holder with the fewest bytes so far
    assert exchange_plan(owners, held) == [(other, 0), (big, 1), (small, 2)]


def test_newest_common_iteration_and_layout_difference():
    assert newest_common_iteration([[4, 6], [4]]) == 4
    assert newest_common_iteration([[6], [4]]) is None
    assert newest_common_iteration([[], [6]]) is None
    same = {"world_size": 2, "tensor_model_parallel_size": 1}
    assert layout_difference(same, dict(same)) is None
    assert layout_difference({"world_size": 4, "tensor_model_parallel_size": 1}, same) == (
        "it was written with world_size=4 but this run has world_size=2 (a local checkpoint loads only under the "
        "parallel layout and world size that wrote it)")


def test_a_part_is_complete_only_once_renamed_and_older_ones_go(tmp_path):
    root = str(tmp_path)
    local_checkpoint_files.write(root, 3, 4, {"x": torch.ones(2)}, {"iteration": 4})
    os.makedirs(local_checkpoint_files.checkpoint_dir(root, 3, 6) + ".tmp")  # a save in progress
    assert local_checkpoint_files.complete_iterations(root, 3) == [4]
    local_checkpoint_files.write(root, 3, 6, {"x": torch.zeros(2)}, {"iteration": 6})
    assert local_checkpoint_files.complete_iterations(root, 3) == [4, 6]
    assert local_checkpoint_files.remove_all_but(root, 3, 6) == ["iter_0000004"]
    part = local_checkpoint_files.checkpoint_dir(root, 3, 6)
    assert sorted(os.listdir(os.path.dirname(part))) == ["iter_0000006"]
    assert local_checkpoint_files.read_metadata(part)["iteration"] == 6
    assert torch.equal(local_checkpoint_files.read_state(part)["x"], torch.zeros(2))

"""A checkpoint is published only when complete: a writer killed mid-write (sync or --async-save) or a failed
background write leaves the previous checkpoint the latest and loadable; --keep-last-n prunes old ones."""

import multiprocessing
import os
import signal
import socket

import pytest
import torch

from tests.unit_tests.dist_checkpointing import interrupted_save_child
from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState
from tests.unit_tests.multiprocess_harness import FORK_SERVER_PRELOAD, run_on_ranks


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _load_and_compare(root):
    from megatron.training import checkpointing

    state = TrainingState(f"--use-distributed-optimizer --ckpt-format torch_dist --load {root}")
    try:
        iteration = checkpointing.load_checkpoint(state.model, state.optimizer, state.scheduler, state.args)
        expected = torch.load(os.path.join(root, "expected_weights.pt"))
        loaded = dict(state.model[0].module.named_parameters())
        equal = all(torch.equal(loaded[name], value) for name, value in expected.items())
        return iteration, equal, len(expected)
    finally:
        state.close()


def test_writer_killed_mid_write_keeps_previous_checkpoint(tmp_path):
    from megatron.training.checkpointing import read_tracker

    # Each writer is a process of its own, forked from the rank pools' fork server (imports already done).
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FORK_SERVER_PRELOAD)
    roots = {mode: tmp_path / mode for mode in ("sync", "async")}
    logs = {mode: tmp_path / f"{mode}.log" for mode in roots}
    children = {}
    for mode, root in roots.items():
        root.mkdir()
        children[mode] = context.Process(target=interrupted_save_child.run_forked,
                                         args=(str(root), mode, _free_port(), str(logs[mode])))
        children[mode].start()
    for mode, child in children.items():
        child.join(timeout=240)
        if child.exitcode is None:
            child.kill()
            child.join()
        output = logs[mode].read_text(errors="replace") if logs[mode].exists() else ""
        assert child.exitcode == -signal.SIGKILL, f"{mode}: exit code {child.exitcode}: {output[-3000:]}"
        root = roots[mode]
        assert read_tracker(root) == 1, mode
        assert sorted(os.listdir(root)) == ["expected_weights.pt", "iter_0000001", "iter_0000002.tmp",
                                            "latest_checkpointed_iteration.txt"], mode
        assert run_on_ranks(1, _load_and_compare, str(root)) == [(1, True, 53)], mode


def _failed_async_write_and_retention(root):
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    from megatron.training import checkpointing

    rank = torch.distributed.get_rank()
    state = TrainingState(f"--use-distributed-optimizer --ckpt-format torch_dist --save {root} --async-save "
                          "--use-persistent-ckpt-worker --keep-last-n 2")
    log = []
    for iteration in (1, 2):
        state.train_steps(1)
        checkpointing.save_checkpoint(iteration, state.model, state.optimizer, state.scheduler, state.args)
        log.append(("pending", iteration, checkpointing.read_tracker(root)))
    weights_at_2 = {name: p.detach().clone() for name, p in state.model[0].module.named_parameters()}
    state.train_steps(1)  # the write of iteration 2 overlaps this step, which changes the weights
    checkpointing.maybe_finalize_async_save(state.args, blocking=True)
    log.append(("finalized", checkpointing.read_tracker(root)))

    real_write_item = dcp_filesystem._write_item

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    if rank == 1:
        dcp_filesystem._write_item = disk_full
    try:
        checkpointing.save_checkpoint(3, state.model, state.optimizer, state.scheduler, state.args)
        checkpointing.maybe_finalize_async_save(state.args, blocking=True)
    finally:
        dcp_filesystem._write_item = real_write_item
    log.append(("failed", checkpointing.read_tracker(root), sorted(os.listdir(root))))
    state.train_steps(1)
    checkpointing.save_checkpoint(4, state.model, state.optimizer, state.scheduler, state.args)
    checkpointing.maybe_finalize_async_save(state.args, blocking=True)
    log.append(("retained", checkpointing.read_tracker(root), sorted(os.listdir(root))))
    from megatron.training.dist_checkpoint import close_async_queue

    close_async_queue()
    state.close()

    # Iteration 2 (published by the async path) holds the weights of iteration 2, not those of the step that
    # ran during its write.
    state = TrainingState(f"--use-distributed-optimizer --ckpt-format torch_dist --load {root}")
    checkpointing.write_tracker(root, 2) if rank == 0 else None
    torch.distributed.barrier()
    loaded_iteration = checkpointing.load_checkpoint(state.model, state.optimizer, state.scheduler, state.args)
    loaded = dict(state.model[0].module.named_parameters())
    equal = all(torch.equal(loaded[name], value) for name, value in weights_at_2.items())
    state.close()
    return log, loaded_iteration, equal


@pytest.mark.parametrize("world_size", [2])
def test_async_save_publishes_only_complete_checkpoints(tmp_path, world_size):
    log, loaded_iteration, equal = run_on_ranks(world_size, _failed_async_write_and_retention, str(tmp_path))[0]
    assert log[0] == ("pending", 1, None)  # not published while being written
    assert log[1] == ("pending", 2, 1)  # saving 2 first finalised 1
    assert log[2] == ("finalized", 2)
    assert log[3] == ("failed", 2, ["iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"])
    assert log[4] == ("retained", 4, ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"])
    assert (loaded_iteration, equal) == (2, True)


class _KilledBetweenRenames(BaseException):
    """Stands for a SIGKILL between publish's two renames (a BaseException: nothing catches it on the way)."""


def _republish_killed_between_renames(root):
    from megatron.training import checkpointing, dist_checkpoint

    state = TrainingState(f"--use-distributed-optimizer --ckpt-format torch_dist --save {root}")
    state.train_steps(1)
    checkpointing.save_checkpoint(2, state.model, state.optimizer, state.scheduler, state.args)
    first = {name: p.detach().clone() for name, p in state.model[0].module.named_parameters()}
    state.train_steps(1)
    real_replace = os.replace

    def replace(source, destination):
        if os.path.basename(source) == "iter_0000002.tmp":  # the old copy is already moved aside
            raise _KilledBetweenRenames()
        return real_replace(source, destination)

    dist_checkpoint.os.replace = replace
    try:
        checkpointing.save_checkpoint(2, state.model, state.optimizer, state.scheduler, state.args)
        killed = False
    except _KilledBetweenRenames:
        killed = True
    finally:
        dist_checkpoint.os.replace = real_replace
    state.close()
    on_disk = (killed, checkpointing.read_tracker(root), sorted(os.listdir(root)))

    # The tracker names iteration 2, whose directory is missing: the load takes the .replaced copy.
    state = TrainingState(f"--use-distributed-optimizer --ckpt-format torch_dist --load {root} --save {root}")
    _, report = dist_checkpoint.load_dist_checkpoint(state.model, state.optimizer, state.scheduler, state.args, 2)
    loaded = dict(state.model[0].module.named_parameters())
    equal = sorted(first) == sorted(loaded) and all(torch.equal(loaded[name], value) for name, value in first.items())
    # Saving iteration 2 again publishes it normally and drops the .replaced copy.
    checkpointing.save_checkpoint(2, state.model, state.optimizer, state.scheduler, state.args)
    state.close()
    return on_disk, equal, report.lines(), sorted(os.listdir(root))


def test_kill_between_the_renames_of_a_republished_iteration_loads_the_previous_copy(tmp_path):
    on_disk, equal, report, after = run_on_ranks(1, _republish_killed_between_renames, str(tmp_path))[0]
    assert on_disk == (True, 2, ["iter_0000002.replaced", "iter_0000002.tmp", "latest_checkpointed_iteration.txt"])
    assert equal
    assert report[0] == (f"loaded checkpoint {tmp_path}/iter_0000002.replaced (written with "
                         "tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=1, "
                         "world_size=1, wrapper=ddp+distributed_optimizer, ckpt_format=torch_dist)")
    assert (f"  note: {tmp_path}/iter_0000002 was missing (a save of the same iteration was interrupted while "
            f"replacing it); loaded the previous copy {tmp_path}/iter_0000002.replaced") in "\n".join(report)
    assert after == ["iter_0000002", "latest_checkpointed_iteration.txt"]


def _disk_full(*args, **kwargs):
    raise OSError(28, "No space left on device")


def _failing_sync_then_async_save(state, module, attribute, iteration, fail_here=True):
    """Saves of `iteration` with `module.attribute` raising a full disk (where `fail_here`), synchronous then
    --async-save: (the synchronous save's error message, what the background save printed)."""
    import contextlib
    import io

    from megatron.training import checkpointing, dist_checkpoint

    real, printed = getattr(module, attribute), io.StringIO()
    if fail_here:
        setattr(module, attribute, _disk_full)
    try:
        with pytest.raises(checkpointing.CheckpointSaveError) as error:
            checkpointing.save_checkpoint(iteration, state.model, state.optimizer, state.scheduler, state.args)
        state.args.async_save = True
        with contextlib.redirect_stdout(printed):
            checkpointing.save_checkpoint(iteration, state.model, state.optimizer, state.scheduler, state.args)
            checkpointing.maybe_finalize_async_save(state.args, blocking=True)
    finally:
        setattr(module, attribute, real)
        dist_checkpoint.close_async_queue()
        state.args.async_save = False
    return str(error.value), printed.getvalue()


def _writes_failing_on_rank_1(root):
    """Saves of iteration 2 whose data file rank 1 cannot write (a full disk), then a --save naming a file:
    (the error each synchronous save raises, what the failed background save printed, the root's entries)."""
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    from megatron.training import checkpointing

    state = TrainingState(f"--ckpt-format torch_dist --save {root}")
    checkpointing.save_checkpoint(1, state.model, state.optimizer, state.scheduler, state.args)
    sync_error, printed = _failing_sync_then_async_save(
        state, dcp_filesystem, "_write_item", 2, fail_here=torch.distributed.get_rank() == 1)
    errors = [sync_error]
    entries = sorted(os.listdir(root))
    state.args.save = os.path.join(root, "latest_checkpointed_iteration.txt", "nested")
    with pytest.raises(checkpointing.CheckpointSaveError) as error:
        checkpointing.save_checkpoint(2, state.model, state.optimizer, state.scheduler, state.args)
    errors.append(str(error.value))
    state.close()
    return errors, printed, entries


def test_a_failed_write_raises_on_every_rank_naming_the_directory_and_what_to_do(tmp_path):
    results = run_on_ranks(2, _writes_failing_on_rank_1, str(tmp_path))
    temporary = tmp_path / "iter_0000002.tmp"
    advice = (f"make --save {tmp_path} writable with free space (or point --save elsewhere) and restart: the latest "
              f"checkpoint under {tmp_path} is still iteration 1")
    sync_error = (f"could not write checkpoint {temporary}: rank 1: OSError: [Errno 28] No space left on device; "
                  f"{advice}")
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    bad_save = f"{tracker}/nested"
    bad_save_error = (f"could not write the checkpoint of iteration 2 to {bad_save}/iter_0000002.tmp (rank 0: "
                      f"NotADirectoryError: [Errno 20] Not a directory: '{bad_save}'); make --save {bad_save} "
                      f"writable with free space (or point --save elsewhere) and restart: {bad_save} holds no "
                      "complete checkpoint yet")
    for errors, _, entries in results:
        assert errors == [sync_error, bad_save_error]
        assert entries == ["iter_0000001", "latest_checkpointed_iteration.txt"]  # the unfinished saves are gone
    assert (f"checkpoint of iteration 2 was NOT saved: a background write failed (see above); {advice}"
            in results[0][1])


def _publish_failing_then_leftovers_removed(root):
    """Iteration 2 saved; a staging directory of iteration 1 and one of iteration 9 left by killed saves. Saves of
    4 whose tracker cannot be written (a full disk), synchronous then --async-save, then a save of 4 that works:
    (the error of the synchronous save, what the ranks printed, the tracker after the failures, the root's entries)."""
    import contextlib
    import io

    from megatron.core.dist_checkpointing import checkpoint_directory
    from megatron.training import checkpointing

    state = TrainingState(f"--ckpt-format torch_dist --save {root}")
    checkpointing.save_checkpoint(2, state.model, state.optimizer, state.scheduler, state.args)
    if torch.distributed.get_rank() == 0:
        os.makedirs(os.path.join(root, "iter_0000001.tmp"))
        os.makedirs(os.path.join(root, "iter_0000009.tmp"))
    sync_error, printed = _failing_sync_then_async_save(state, checkpoint_directory, "write_tracker", 4)
    tracker = checkpointing.read_tracker(root)
    published = io.StringIO()
    with contextlib.redirect_stdout(published):
        checkpointing.save_checkpoint(4, state.model, state.optimizer, state.scheduler, state.args)
    state.close()
    return sync_error, printed + published.getvalue(), tracker, sorted(os.listdir(root))


def test_a_failed_publish_raises_on_every_rank_and_a_later_save_removes_superseded_staging(tmp_path):
    results = run_on_ranks(2, _publish_failing_then_leftovers_removed, str(tmp_path))
    failure = (f"could not publish the checkpoint of iteration 4 (rename {tmp_path}/iter_0000004.tmp into place, then "
               f"point {tmp_path}/latest_checkpointed_iteration.txt at it) (rank 0: OSError: [Errno 28] No space left "
               f"on device); make --save {tmp_path} writable with free space (or point --save elsewhere) and restart: "
               f"the latest checkpoint under {tmp_path} is still iteration 2")
    for error, printed, tracker, entries in results:
        assert (error, tracker) == (failure, 2)
        assert entries == ["iter_0000002", "iter_0000004", "iter_0000009.tmp", "latest_checkpointed_iteration.txt"]
    printed = results[0][1]
    assert f"checkpoint of iteration 4 was NOT saved: {failure}\n" in printed  # --async-save: training goes on
    assert (f"removed what interrupted saves left under {tmp_path} (superseded by the checkpoint of iteration 4): "
            "iter_0000001.tmp\n") in printed

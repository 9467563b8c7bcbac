"""Torch-format saves that fail or are killed part-way: the latest checkpoint stays loadable, every rank learns
of a failure, and a later save removes what the interrupted ones left."""

import errno
import os
import re

import pytest
import torch

from megatron.training import checkpointing
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.training.torch_format_checkpoints import checkpoint_args, trained_state


def _save_fail_then_load(root, pipeline_size, failure):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pipeline_size)
    model_parallel_cuda_manual_seed(5)
    rank = torch.distributed.get_rank()
    args = checkpoint_args(root, pipeline_model_parallel_size=pipeline_size, consumed_train_samples=80)

    # Data-parallel replicas hold equal states; pipeline stages different ones.
    stage_seed = 10 + (rank if pipeline_size > 1 else 0)
    model, optimizer, scheduler = trained_state(seed=stage_seed)
    checkpointing.save_checkpoint(10, model, optimizer, scheduler, args)
    saved_weight = model.weight.detach().clone()
    saved_optimizer_step = optimizer.state_dict()["state"][0]["step"].item()
    expected_random = torch.rand(3)  # drawn right after saving: loading the RNG state must replay it

    # A later save dies, either while a rank writes its model file (every rank writes one here) or after
    # all files are written but before the tracker is updated (an I/O error on rank 0, which every rank then
    # raises): either way iteration 10 stays the latest.
    model_20, optimizer_20, scheduler_20 = trained_state(seed=99)
    from megatron.core.dist_checkpointing import checkpoint_directory

    real_serialize, real_write_tracker = checkpointing._serialize, checkpoint_directory.write_tracker

    def dying_serialize(obj, stream):
        stream.write(b"truncated")
        raise RuntimeError("node lost")

    def dying_write_tracker(root, iteration):
        with open(os.path.join(root, checkpointing.TRACKER_FILENAME + ".tmp.dead"), "w") as stream:
            stream.write("2")
        raise OSError(errno.EIO, "node lost")

    if failure == "model_file":
        checkpointing._serialize = dying_serialize
    else:
        checkpoint_directory.write_tracker = dying_write_tracker
    expected_error = RuntimeError if failure == "model_file" else checkpointing.CheckpointSaveError
    message = "node lost" if failure == "model_file" else re.escape(
        f"(rank 0: OSError: [Errno {errno.EIO}] node lost); make --save {root} writable with free space (or point "
        f"--save elsewhere) and restart: the latest checkpoint under {root} is still iteration 10")
    try:
        with pytest.raises(expected_error, match=message):  # on every rank
            checkpointing.save_checkpoint(20, model_20, optimizer_20, scheduler_20, args)
    finally:
        checkpointing._serialize, checkpoint_directory.write_tracker = real_serialize, real_write_tracker
    torch.distributed.barrier()
    assert checkpointing.read_tracker(root) == 10

    fresh_model, fresh_optimizer, fresh_scheduler = trained_state(seed=1234)
    args.consumed_train_samples = 0
    iteration = checkpointing.load_checkpoint(fresh_model, fresh_optimizer, fresh_scheduler, args)
    replayed_random = torch.rand(3)
    expected_files = {
        (1, 1): ["mp_rank_00"],
        (2, 1): ["mp_rank_00"],
        (2, 2): ["mp_rank_00_000", "mp_rank_00_001"],
    }[(torch.distributed.get_world_size(), pipeline_size)]
    assert sorted(os.listdir(os.path.join(root, "iter_0000010"))) == expected_files
    return {
        "iteration": iteration,
        "consumed": args.consumed_train_samples,
        "weights_equal": torch.equal(fresh_model.weight, saved_weight),
        "optimizer_step": fresh_optimizer.state_dict()["state"][0]["step"].item() == saved_optimizer_step,
        "scheduler_steps": fresh_scheduler.num_steps,
        "rng_replayed": torch.equal(replayed_random, expected_random),
        "root": sorted(name for name in os.listdir(root) if not name.startswith(checkpointing.TRACKER_FILENAME)),
    }


@pytest.mark.parametrize(
    "world_size, pipeline_size, failure",
    [(1, 1, "model_file"), (1, 1, "tracker"), (2, 1, "tracker"), (2, 2, "model_file"), (2, 2, "tracker")],
)
def test_interrupted_save_keeps_previous_checkpoint_loadable(tmp_path, world_size, pipeline_size, failure):
    results = run_on_ranks(world_size, _save_fail_then_load, str(tmp_path), pipeline_size, failure)
    for rank, result in enumerate(results):
        assert result["iteration"] == 10 and result["consumed"] == 80
        assert result["weights_equal"] and result["optimizer_step"] and result["rng_replayed"]
        assert result["scheduler_steps"] == 10 + (rank if pipeline_size > 1 else 0)
    # A save dying while a file is written leaves its files in iter_0000020.tmp, never under the published name;
    # one dying at the tracker has renamed its complete directory into place.
    parts = {(1, 1): ["mp_rank_00"], (2, 1): ["mp_rank_00"], (2, 2): ["mp_rank_00_000", "mp_rank_00_001"]}[
        (world_size, pipeline_size)]
    if failure == "model_file":
        assert results[0]["root"] == ["iter_0000010", "iter_0000020.tmp"]
        assert sorted(os.listdir(tmp_path / "iter_0000020.tmp")) == parts
        assert not any(name.endswith(".pt") for part in parts for name in os.listdir(tmp_path / "iter_0000020.tmp" /
                                                                                       part))
    else:
        assert results[0]["root"] == ["iter_0000010", "iter_0000020"]
        assert [name for part in parts for name in os.listdir(tmp_path / "iter_0000020" / part)] == \
            ["model_optim_rng.pt"] * len(parts)


def _resave_published_iteration_killed_between_files(root):
    """Iteration 10 saved (the tracker names it), then saved again from another state by a run that dies after
    the distributed optimizer's shard is written and before the model file is: iteration 10 must still load whole,
    weights and optimizer state of the same save."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(5)
    args = checkpoint_args(root, use_distributed_optimizer=True)
    model, optimizer, scheduler = trained_state(seed=10)
    checkpointing.save_checkpoint(10, model, optimizer, scheduler, args)
    saved_weight, saved_moment = model.weight.detach().clone(), optimizer.state_dict()["state"][0]["exp_avg"].clone()

    other_model, other_optimizer, other_scheduler = trained_state(seed=99)
    real_serialize = checkpointing._serialize

    def die_on_the_model_file(obj, stream):
        if "optimizer" in obj and len(obj) == 1:  # the optimizer shard: written whole
            return real_serialize(obj, stream)
        raise KeyboardInterrupt("node lost")  # not an OSError: nothing on the way handles it

    checkpointing._serialize = die_on_the_model_file
    try:
        with pytest.raises(KeyboardInterrupt):
            checkpointing.save_checkpoint(10, other_model, other_optimizer, other_scheduler, args)
    finally:
        checkpointing._serialize = real_serialize

    fresh_model, fresh_optimizer, fresh_scheduler = trained_state(seed=1234)
    iteration = checkpointing.load_checkpoint(fresh_model, fresh_optimizer, fresh_scheduler, args)
    return (iteration, torch.equal(fresh_model.weight, saved_weight),
            torch.equal(fresh_optimizer.state_dict()["state"][0]["exp_avg"], saved_moment), fresh_scheduler.num_steps)


def test_a_killed_save_of_the_latest_iteration_again_leaves_it_whole(tmp_path):
    assert run_on_ranks(1, _resave_published_iteration_killed_between_files, str(tmp_path)) == [(10, True, True, 10)]


class _KilledBetweenRenames(BaseException):
    """Stands for a SIGKILL between the two renames that publish an iteration saved again."""


def _resave_killed_between_renames(root):
    """Iteration 10 saved, then saved again by a run killed after the old copy moved aside and before the new one
    moved in: the tracker names 10, whose directory is missing; the load takes the old copy."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(5)
    args = checkpoint_args(root)
    model, optimizer, scheduler = trained_state(seed=10)
    checkpointing.save_checkpoint(10, model, optimizer, scheduler, args)
    saved_weight = model.weight.detach().clone()
    real_replace = os.replace

    def replace(source, destination):
        if os.path.basename(source) == "iter_0000010.tmp":
            raise _KilledBetweenRenames()
        return real_replace(source, destination)

    other_model, other_optimizer, other_scheduler = trained_state(seed=99)
    checkpointing.os.replace = replace
    try:
        with pytest.raises(_KilledBetweenRenames):
            checkpointing.save_checkpoint(10, other_model, other_optimizer, other_scheduler, args)
    finally:
        checkpointing.os.replace = real_replace
    entries = sorted(os.listdir(root))
    fresh_model, fresh_optimizer, fresh_scheduler = trained_state(seed=1234)
    iteration = checkpointing.load_checkpoint(fresh_model, fresh_optimizer, fresh_scheduler, args)
    return entries, iteration, torch.equal(fresh_model.weight, saved_weight), fresh_scheduler.num_steps


def test_a_save_again_killed_between_its_renames_loads_the_previous_copy(tmp_path):
    entries, iteration, equal, scheduler_steps = run_on_ranks(1, _resave_killed_between_renames, str(tmp_path))[0]
    assert entries == ["iter_0000010.replaced", "iter_0000010.tmp", "latest_checkpointed_iteration.txt"]
    assert (iteration, equal, scheduler_steps) == (10, True, 10)


def _leftovers_of_interrupted_saves(root):
    """Iteration 10 saved beside what killed saves left: a staging directory of an earlier iteration, a stale
    `.replaced` copy beside its complete directory, the only (`.replaced`) copy of iteration 7, and a staging
    directory of a later iteration. Saving 20: (the root's entries, what rank 0 printed, the error of a load whose
    tracker names a missing iteration)."""
    import contextlib
    import io

    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.errors import CheckpointError
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(5)
    args = checkpoint_args(root)
    model, optimizer, scheduler = trained_state(seed=10)
    checkpointing.save_checkpoint(10, model, optimizer, scheduler, args)
    for leftover in ("iter_0000005.tmp/mp_rank_00", "iter_0000010.replaced/mp_rank_00",
                     "iter_0000007.replaced/mp_rank_00", "iter_0000030.tmp/mp_rank_00", "non_persistent"):
        os.makedirs(os.path.join(root, leftover))
    with open(os.path.join(root, "iter_0000005.tmp", "mp_rank_00", "model_optim_rng.pt.tmp.123"), "wb") as stream:
        stream.write(b"partial")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        checkpointing.save_checkpoint(20, model, optimizer, scheduler, args)
    entries = sorted(os.listdir(root))
    checkpointing.write_tracker(root, 40)
    with pytest.raises(CheckpointError) as error:
        checkpointing.load_checkpoint(model, optimizer, scheduler, args)
    return entries, printed.getvalue(), str(error.value)


def test_a_save_removes_the_staging_left_by_interrupted_saves_it_supersedes(tmp_path):
    entries, printed, error = run_on_ranks(1, _leftovers_of_interrupted_saves, str(tmp_path))[0]
    # Kept: the only copy of iteration 7, the staging directory of a later iteration, other entries.
    assert entries == ["iter_0000007.replaced", "iter_0000010", "iter_0000020", "iter_0000030.tmp",
                       "latest_checkpointed_iteration.txt", "non_persistent"]
    assert (f"removed what interrupted saves left under {tmp_path} (superseded by the checkpoint of iteration 20): "
            "iter_0000005.tmp, iter_0000010.replaced\n") in printed
    assert error == (f"{tmp_path}/latest_checkpointed_iteration.txt names iteration 40, but {tmp_path}/iter_0000040 "
                     f"does not exist (nor a .replaced copy of it); load one of the checkpoints there with --load "
                     f"{tmp_path} --ckpt-step N (N: 10, 20), or write one of those iterations into the tracker")


def _save_failing_on_rank_0(root):
    """A save whose model file cannot be written on rank 0 (the only writer under DDP): (error on each rank, the
    tracker, the root's entries)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(5)
    args = checkpoint_args(root)
    model, optimizer, scheduler = trained_state(seed=10)
    checkpointing.save_checkpoint(10, model, optimizer, scheduler, args)
    real_serialize = checkpointing._serialize

    def disk_full(obj, stream):
        raise OSError(28, "No space left on device")

    if torch.distributed.get_rank() == 0:
        checkpointing._serialize = disk_full
    try:
        with pytest.raises(checkpointing.CheckpointSaveError) as error:
            checkpointing.save_checkpoint(20, model, optimizer, scheduler, args)
    finally:
        checkpointing._serialize = real_serialize
    return str(error.value), checkpointing.read_tracker(root), sorted(os.listdir(root))


def test_a_save_failing_on_one_rank_fails_on_every_rank_naming_the_directory(tmp_path):
    results = run_on_ranks(2, _save_failing_on_rank_0, str(tmp_path), timeout_s=60)
    message = (f"could not write the checkpoint of iteration 20 to {tmp_path / 'iter_0000020.tmp'} (rank 0: OSError: "
               f"[Errno 28] No space left on device); make --save {tmp_path} writable with free space (or point "
               f"--save elsewhere) and restart: the latest checkpoint under {tmp_path} is still iteration 10")
    assert results == [(message, 10, ["iter_0000010", "latest_checkpointed_iteration.txt"])] * 2

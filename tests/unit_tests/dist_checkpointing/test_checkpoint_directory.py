"""Iteration directories past iteration 9,999,999: `iter_{:07d}` gives them eight digits (as upstream names them),
and every listing of a checkpoint root must still count them."""

import os

import pytest

from megatron.core.dist_checkpointing.checkpoint_directory import (
    earlier_checkpoint_advice,
    iteration_dir_name,
    move_into_place,
    published_iterations,
    read_tracker,
    unwritten_save_advice,
    write_tracker,
)
from megatron.training.checkpoint_retention import prune_to_retain_interval, superseded_leftovers
from megatron.training.checkpoint_sources import checkpoint_iterations
from megatron.training.local_checkpoint_files import METADATA_FILENAME, STATE_FILENAME, checkpoint_dir, \
    complete_iterations

ITERATIONS = (9_999_000, 10_000_000, 10_001_000)


def _publish_all(root, keep_last_n=None):
    for iteration in ITERATIONS:
        staging = os.path.join(root, iteration_dir_name(iteration) + ".tmp")
        os.makedirs(staging)
        open(os.path.join(staging, ".metadata"), "w").close()
        move_into_place(str(root), iteration, staging, keep_last_n)


def test_eight_digit_iterations_are_listed_and_pruned(tmp_path):
    assert iteration_dir_name(10_000_000) == "iter_10000000"
    _publish_all(tmp_path)
    assert published_iterations(str(tmp_path)) == list(ITERATIONS)
    assert checkpoint_iterations(str(tmp_path)) == list(ITERATIONS)
    assert "--ckpt-step 10000000" in earlier_checkpoint_advice(str(tmp_path / "iter_10001000"))
    assert superseded_leftovers(["iter_10000000.tmp", "iter_10002000.tmp"], 10_001_000) == ["iter_10000000.tmp"]
    assert prune_to_retain_interval(str(tmp_path), 10_001_000, 2_000_000) == [9_999_000]
    assert read_tracker(str(tmp_path)) == 10_001_000


def test_keep_last_n_prunes_eight_digit_iterations(tmp_path):
    _publish_all(tmp_path, keep_last_n=1)
    assert sorted(os.listdir(tmp_path)) == ["iter_10001000", "latest_checkpointed_iteration.txt"]


def test_local_checkpoint_parts_with_eight_digit_iterations_are_found(tmp_path):
    for iteration in ITERATIONS:
        directory = checkpoint_dir(str(tmp_path), 0, iteration)
        os.makedirs(directory)
        for name in (STATE_FILENAME, METADATA_FILENAME):
            open(os.path.join(directory, name), "w").close()
    assert complete_iterations(str(tmp_path), 0) == list(ITERATIONS)


@pytest.mark.parametrize("content, shown", [(b"\xff\xfe\x00", repr("\ufffd\ufffd\x00")), (b"-3", "'-3'"),
                                            (b"", "''"), (b"20.0", "'20.0'")])
def test_a_damaged_tracker_names_the_file_and_what_it_should_hold(tmp_path, content, shown):
    (tmp_path / "latest_checkpointed_iteration.txt").write_bytes(content)
    with pytest.raises(ValueError) as error:
        read_tracker(str(tmp_path))
    assert str(error.value) == (f"{tmp_path}/latest_checkpointed_iteration.txt should hold an iteration number (or "
                                f"'release'), found {shown}; write the iteration of a checkpoint under it there")
    os.makedirs(tmp_path / "iter_0000010")
    with pytest.raises(ValueError, match=r"under it there \(the iterations there: 10\)$"):
        read_tracker(str(tmp_path))


def test_a_failed_save_under_a_damaged_tracker_still_gives_its_advice(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("x")
    assert unwritten_save_advice(str(tmp_path)) == (
        f"make --save {tmp_path} writable with free space (or point --save elsewhere) and restart: its tracker is "
        f"damaged too: {tmp_path}/latest_checkpointed_iteration.txt should hold an iteration number (or 'release'), "
        "found 'x'; write the iteration of a checkpoint under it there")


def test_a_tracker_write_failing_on_a_full_disk_leaves_the_previous_tracker_alone(tmp_path, monkeypatch):
    write_tracker(str(tmp_path), 1)

    def disk_full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        write_tracker(str(tmp_path), 2)
    assert os.listdir(tmp_path) == ["latest_checkpointed_iteration.txt"]
    assert read_tracker(str(tmp_path)) == 1

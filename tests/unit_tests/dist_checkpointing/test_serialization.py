"""serialization.save / load by one process without a process group (tools, and --use-checkpoint-args reading
a checkpoint's arguments before training starts its process group): the values round-trip and torch's warning
about a missing process group, which would print on every rank of every launch, is not shown."""

import argparse
import warnings

import pytest
import torch

from megatron.core.dist_checkpointing import serialization
from megatron.training import checkpoint_sources


def test_single_process_round_trip_without_the_no_process_group_warning(tmp_path):
    saved_args = argparse.Namespace(hidden_size=32, num_layers=2)
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        serialization.save({"model.w": weight, "common": {"args": saved_args}}, str(tmp_path / "iter_0000003"),
                           single_process=True)
        (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
        source = checkpoint_sources.checkpoint_to_load(argparse.Namespace(load=str(tmp_path), ckpt_step=None,
                                                                          non_persistent_global_ckpt_dir=None))
        read_args = checkpoint_sources.saved_args(source)
        target = {"model.w": torch.zeros(2, 3)}
        serialization.load(target, str(tmp_path / "iter_0000003"), single_process=True)
    assert vars(read_args) == {"hidden_size": 32, "num_layers": 2}
    assert torch.equal(target["model.w"], weight)
    assert [str(w.message) for w in caught if "torch.distributed is disabled" in str(w.message)] == []


def test_a_tracked_directory_without_its_index_names_the_checkpoint_to_resume_instead(tmp_path):
    """A tracker naming a directory whose `.metadata` is gone (a partial copy of the checkpoint): the error says
    which earlier checkpoint under the same root loads."""
    serialization.save({"w": torch.ones(2)}, str(tmp_path / "iter_0000010"), single_process=True)
    incomplete = tmp_path / "iter_0000020"
    incomplete.mkdir()
    with pytest.raises(serialization.CheckpointError) as error:
        serialization.read_metadata(str(incomplete))
    assert str(error.value).endswith(f"latest_checkpointed_iteration.txt); to resume the checkpoint before it, pass "
                                     f"--load {tmp_path} --ckpt-step 10 (the earlier iterations there: 10)")

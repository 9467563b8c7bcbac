"""Each `--dist-ckpt-strictness` mode on both kinds of key mismatch, as upstream's `StrictHandling` defines them:
an "unexpected" key is asked for by the load but not in the checkpoint, a "missing" key is in the checkpoint but
asked for by no one."""

import contextlib
import io

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor
from megatron.core.dist_checkpointing.strictness import CheckpointKeyError
from megatron.core.dist_checkpointing.validation import StrictHandling


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("strictness") / "ckpt"
    dist_checkpointing.save({"kept": ShardedLogicalTensor.from_local(torch.arange(4.0)),
                             "extra": ShardedLogicalTensor.from_local(torch.ones(3))}, directory)
    return directory


def _load(checkpoint, strict, ask_for_absent):
    """(result, printed, the target of the absent key) of a load asking for `kept` (and `absent`)."""
    kept, absent = torch.zeros(4), torch.full((2,), 5.0)
    request = {"kept": ShardedLogicalTensor.from_local(kept)}
    if ask_for_absent:
        request["absent"] = ShardedLogicalTensor.from_local(absent)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = dist_checkpointing.load(request, checkpoint, strict=strict)
    assert torch.equal(kept, torch.arange(4.0))
    return result, printed.getvalue(), absent


@pytest.mark.parametrize("strict", ["log_unexpected", "log_all", "return_unexpected", "return_all", "ignore_all"])
def test_modes_that_skip_keys_the_checkpoint_lacks(checkpoint, strict):
    result, printed, absent = _load(checkpoint, strict, ask_for_absent=True)
    assert torch.equal(absent, torch.full((2,), 5.0))  # left as initialised
    assert ("absent" in printed) == strict.startswith("log_")
    assert ("extra" in printed) == (strict == "log_all")
    if strict == "return_unexpected":
        assert result[1:] == (set(), {"absent"})
    elif strict == "return_all":
        assert result[1:] == ({"extra"}, {"absent"})
    else:
        assert set(result) == {"kept"}


@pytest.mark.parametrize("strict", ["assume_ok_unexpected", "raise_unexpected", "raise_all"])
def test_modes_that_fail_on_keys_the_checkpoint_lacks(checkpoint, strict):
    with pytest.raises(CheckpointKeyError, match="not in the checkpoint: absent"):
        _load(checkpoint, strict, ask_for_absent=True)


@pytest.mark.parametrize("strict", ["assume_ok_unexpected", "log_unexpected", "raise_unexpected",
                                    "return_unexpected", "ignore_all"])
def test_unexpected_modes_ignore_checkpoint_keys_no_one_asks_for(checkpoint, strict):
    result, printed, _ = _load(checkpoint, strict, ask_for_absent=False)
    assert "extra" not in printed
    assert result[1:] == (set(), set()) if strict == "return_unexpected" else set(result) == {"kept"}


def test_raise_all_fails_on_checkpoint_keys_no_one_asks_for(checkpoint):
    with pytest.raises(CheckpointKeyError, match=r"1 tensor\(s\) in the checkpoint are not in the model: extra"):
        _load(checkpoint, "raise_all", ask_for_absent=False)


def test_upstreams_questions_about_a_mode():
    returning = {mode for mode in StrictHandling if StrictHandling.requires_returning_mismatch_keys(mode)}
    assert returning == {StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL}
    global_keys = {mode for mode in StrictHandling if StrictHandling.requires_global_app_metadata(mode)}
    assert global_keys == {StrictHandling.LOG_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL}
    checked = {mode for mode in StrictHandling if StrictHandling.requires_explicit_ckpt_mismatch_check(mode)}
    assert checked == set(StrictHandling) - {StrictHandling.ASSUME_OK_UNEXPECTED}

"""torch_dist loads of FP8 amax histories saved with another `--fp8-amax-history-len`: read at the saved shape,
fitted to the model's (newest first: the newest amaxes kept, zeros past the saved ones), into Megatron DDP's
buffers (the targets are views of them), through upstream's `load`, and into Megatron-FSDP chunks (the targets
are copied in by its `load_state_dict`). A history that cannot be fitted is an error naming the flag."""

import pytest
import torch

from megatron.core.dist_checkpointing import serialization
from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor
from tests.unit_tests.fp8.fsdp_fp8_model import amax_histories, fsdp_fp8_chunk
from tests.unit_tests.multiprocess_harness import run_on_ranks

KEY = "model.decoder.layers.0.mlp.linear_fc1.fp8_amax_history"


def _saved_histories():
    return torch.arange(1.0, 13.0).reshape(3, 4)  # column 0 is the newest amax of each role


def _expected(saved, length):
    kept = min(length, saved.shape[1])
    return torch.cat([saved[:, :kept], torch.zeros(3, length - kept)], dim=1)


def _save(directory):
    weight = torch.randn(2, 3)
    serialization.save({KEY: ShardedLogicalTensor.from_local(_saved_histories()), "model.w": weight}, directory)
    return weight


@pytest.mark.parametrize("length", [8, 2])
def test_histories_load_fitted_into_the_model_buffers(tmp_path, length):
    directory = str(tmp_path / "iter_0000001")
    weight = _save(directory)
    buffer, loaded_weight = torch.full((3, length), -1.0), torch.zeros(2, 3)
    target = ShardedLogicalTensor.from_local(buffer)
    targets = {KEY: target, "model.w": ShardedLogicalTensor.from_local(loaded_weight)}
    metadata = serialization.read_metadata(directory)
    serialization.check_shapes(targets, metadata, directory)
    serialization.load(targets, directory, metadata=metadata)
    assert torch.equal(buffer, _expected(_saved_histories(), length))
    assert torch.equal(loaded_weight, weight)
    assert targets[KEY] is target  # the caller's targets, as it passed them


def test_upstream_load_returns_the_fitted_histories(tmp_path):
    from megatron.core import dist_checkpointing

    _save(str(tmp_path))
    loaded = dist_checkpointing.load({KEY: ShardedLogicalTensor.from_local(torch.zeros(3, 6))}, str(tmp_path))
    assert torch.equal(loaded[KEY], _expected(_saved_histories(), 6))


def test_histories_that_cannot_be_fitted_name_the_flag_and_both_lengths(tmp_path):
    _save(str(tmp_path))
    # A piece holding only part of the history length (no layout splits it): not fitted.
    split = ShardedLogicalTensor((3, 8), [((0, 0), torch.zeros(3, 4))])
    with pytest.raises(serialization.CheckpointShapeError) as error:
        serialization.check_shapes({KEY: split}, serialization.read_metadata(str(tmp_path)), str(tmp_path))
    message = str(error.value)
    assert KEY in message and "--fp8-amax-history-len 4" in message and "--fp8-amax-history-len 8" in message
    assert "--hidden-size" not in message


def _fsdp_save_and_load_on_ranks(directory, lengths):
    import torch.distributed as dist

    from megatron.core import fp8_utils
    from megatron.core.dist_checkpointing import wrappers

    tokens = torch.randint(0, 32, (3, 2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    chunk = fsdp_fp8_chunk(4)
    for step_tokens in tokens:  # three steps: three amaxes in each history of length 4
        chunk.zero_grad_buffer()
        chunk(step_tokens, torch.arange(8).expand_as(step_tokens), None, labels=step_tokens).sum().backward()
        fp8_utils.reduce_fp8_amaxes([chunk])
    serialization.save(wrappers.model_state([chunk], for_saving=True), directory)
    saved = amax_histories(chunk)
    loaded = {}
    for length in lengths:
        resumed = fsdp_fp8_chunk(length)
        targets, finish = wrappers.model_load_targets([resumed])
        metadata = serialization.read_metadata(directory)
        serialization.check_shapes(targets, metadata, directory)
        serialization.load(targets, directory, metadata=metadata)
        finish(set(targets))
        loaded[length] = amax_histories(resumed)
    return saved, loaded


def test_megatron_fsdp_load_fits_the_histories(tmp_path):
    for saved, loaded in run_on_ranks(2, _fsdp_save_and_load_on_ranks, str(tmp_path / "iter_0000001"), (8, 2)):
        assert len(saved) == 4  # the four FP8 linears of the one transformer layer
        for history in saved:
            assert (history[:, :3] > 0).all() and torch.equal(history[:, 3], torch.zeros(3))
        for length, histories in loaded.items():
            assert [torch.equal(got, _expected(want, length)) for got, want in zip(histories, saved)] == [True] * 4

"""`--manual-gc`: the automatic collector is off while training, every rank collects at the same iterations (start,
every --manual-gc-interval, around evaluation unless --no-manual-gc-eval, end), and training is unchanged."""

import gc
import json

import pytest
import torch

from megatron.training.manual_gc import ManualGarbageCollection
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.training.test_training import TINY_GPT


def _full_collections():
    """A list that grows by one for every generation-2 (full) collection until the returned stop() is called."""
    seen = []

    def callback(phase, info):
        if phase == "start" and info["generation"] == 2:
            seen.append(1)

    gc.callbacks.append(callback)
    return seen, lambda: gc.callbacks.remove(callback)


def test_collects_at_start_interval_evaluation_and_end():
    assert gc.isenabled()
    seen, stop = _full_collections()
    try:
        with ManualGarbageCollection(True, interval=3) as manual_gc:
            assert not gc.isenabled() and len(seen) == 1  # the start
            for iteration in range(1, 8):
                manual_gc.after_iteration(iteration)
            assert len(seen) == 3  # iterations 3 and 6
            manual_gc.around_evaluation_step()
            manual_gc.around_evaluation_step()
            assert len(seen) == 5
        assert gc.isenabled() and len(seen) == 6 and manual_gc.collections == 6  # the end
    finally:
        stop()


def test_off_by_default_and_without_evaluation_collections():
    seen, stop = _full_collections()
    try:
        with ManualGarbageCollection(False, interval=1) as inert:
            inert.after_iteration(1)
            assert gc.isenabled()
        with ManualGarbageCollection(True, interval=0, around_evaluation=False) as manual_gc:
            manual_gc.after_iteration(5)
            manual_gc.around_evaluation_step()
        assert manual_gc.collections == 2 and gc.isenabled()
    finally:
        stop()
    with pytest.raises(ValueError, match="--manual-gc-interval must be >= 0"):
        ManualGarbageCollection(True, interval=-1)


def _train(workdir, extra_args):
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    gc_enabled_in_steps = []

    def forward_step(data_iterator, model):
        gc_enabled_in_steps.append(gc.isenabled())
        return pretrain_gpt.forward_step(data_iterator, model)

    metrics = f"{workdir}/metrics_{len(extra_args)}.jsonl"
    argv = f"{TINY_GPT} --train-iters 4 --metrics-file {metrics} {extra_args}".split()
    pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
             ModelType.encoder_or_decoder, forward_step, argv=argv)
    losses = []
    if torch.distributed.get_rank() == 0:
        with open(metrics) as records:
            losses = [json.loads(line)["lm loss"] for line in records]
    return {"losses": losses, "gc_on_in_steps": sorted(set(gc_enabled_in_steps)), "gc_on_after": gc.isenabled()}


def _with_and_without_manual_gc(workdir):
    return _train(workdir, ""), _train(workdir, "--manual-gc --manual-gc-interval 2")


@pytest.mark.parametrize("world_size", [2])
def test_training_is_unchanged_and_the_collector_is_off_in_steps(tmp_path, world_size):
    results = run_on_ranks(world_size, _with_and_without_manual_gc, str(tmp_path))
    for automatic, manual in results:
        assert automatic["gc_on_in_steps"] == [True] and manual["gc_on_in_steps"] == [False]
        assert manual["gc_on_after"]
    automatic, manual = results[0]  # rank 0 read the metrics files
    assert len(automatic["losses"]) == 4 and manual["losses"] == automatic["losses"]

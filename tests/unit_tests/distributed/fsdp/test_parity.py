"""Megatron-FSDP training equals single-process AdamW training, for every strategy, DP size and precision.

fp32 on CPU is deterministic, so losses and final weights must agree to ~1e-5 (the only difference is the
summation order of the gradient reduction). With bf16 compute weights (fp32 main weights and AdamW state),
the reference keeps fp32 master weights too, but gradients are summed in bf16 across ranks (main grads default
to the parameter dtype) instead of being computed on the whole batch at once; bf16 keeps 8 mantissa bits
(relative rounding ~4e-3), so losses agree to a few 1e-3 and the tolerance is 2e-2.
"""

import pytest
import torch

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS = 3


def _wrap(strategy, overlap=True, dtype=torch.float32, model_kwargs=None, **kwargs):
    import megatron_fsdp

    model = models.make_model(0, dtype, **(model_kwargs or {}))
    optimizer = models.make_optimizer([p for p in model.parameters() if p.requires_grad])
    return megatron_fsdp.fully_shard(model, optimizer, fsdp_unit_modules=[models.Block], zero_dp_strategy=strategy,
                                     overlap_grad_reduce=overlap, overlap_param_gather=overlap, **kwargs)


def _train_matrix():
    """Every strategy with overlap off/on in fp32, and with bf16 compute; returns losses and final weights."""
    results = {}
    for strategy in range(4):
        for overlap in (False, True):
            model, optimizer = _wrap(strategy, overlap)
            losses = models.train_sharded(model, optimizer, NUM_STEPS)
            results[("fp32", strategy, overlap)] = (losses, models.full_params(model))
        model, optimizer = _wrap(strategy, True, torch.bfloat16)
        results[("bf16", strategy, True)] = (models.train_sharded(model, optimizer, NUM_STEPS, torch.bfloat16),
                                             models.precision_of(model, optimizer))
    return results


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_strategies_match_single_process(world_size):
    reference, reference_params = models.reference_losses(NUM_STEPS)
    reference_bf16 = models.reference_losses_mixed(NUM_STEPS)
    results = run_on_ranks(world_size, _train_matrix)[0]
    for strategy in range(4):
        for overlap in (False, True):
            losses, params = results[("fp32", strategy, overlap)]
            assert losses == pytest.approx(reference, abs=1e-5), (strategy, overlap)
            assert set(params) == set(reference_params)
            for name, value in params.items():
                torch.testing.assert_close(value, reference_params[name], atol=1e-5, rtol=1e-5, msg=name)
        # overlapping communication changes when collectives run, never what they compute
        assert results[("fp32", strategy, False)][0] == results[("fp32", strategy, True)][0]
        bf16_losses, precision = results[("bf16", strategy, True)]
        assert bf16_losses == pytest.approx(reference_bf16, abs=2e-2), strategy
        models.assert_ran_in_low_precision(bf16_losses, precision, reference_bf16, reference)


def _variants():
    """Features that change the schedule but not the math: activation checkpointing, the double-buffer pool,
    no unit modules at all, no bucketing, averaging inside the collective, syncing only at the step."""
    import megatron_fsdp

    results = {}
    cases = {
        "checkpointed": dict(strategy=3, model_kwargs={"checkpoint_blocks": True}),
        "checkpointed_no_overlap": dict(strategy=3, overlap=False, model_kwargs={"checkpoint_blocks": True}),
        "double_buffer": dict(strategy=3, fsdp_double_buffer=True),
        "double_buffer_checkpointed": dict(strategy=3, fsdp_double_buffer=True,
                                           model_kwargs={"checkpoint_blocks": True}),
        "average_in_collective_s3": dict(strategy=3, average_in_collective=True),
        "average_in_collective_s0": dict(strategy=0, average_in_collective=True),
        "sync_at_step_s0": dict(strategy=0, sync_model_each_microbatch=False),
        "sync_at_step_s1": dict(strategy="optim", sync_model_each_microbatch=False),
    }
    for name, case in cases.items():
        case = dict(case)
        model, optimizer = _wrap(case.pop("strategy"), case.pop("overlap", True), **case)
        results[name] = models.train_sharded(model, optimizer, NUM_STEPS)
    for strategy in (0, 3):
        model = models.make_model(0)
        optimizer = models.make_optimizer([p for p in model.parameters() if p.requires_grad])
        model, optimizer = megatron_fsdp.fully_shard(model, optimizer, zero_dp_strategy=strategy,
                                                     disable_bucketing=True)
        results[f"no_units_s{strategy}"] = models.train_sharded(model, optimizer, NUM_STEPS)
    return results


@pytest.mark.parametrize("world_size", [3])
def test_schedule_variants_match_single_process(world_size):
    reference, _ = models.reference_losses(NUM_STEPS)
    checkpointed_reference, _ = models.reference_losses(NUM_STEPS, model_kwargs={"checkpoint_blocks": True})
    assert checkpointed_reference == pytest.approx(reference, abs=1e-6)
    for name, losses in run_on_ranks(world_size, _variants)[0].items():
        assert losses == pytest.approx(reference, abs=1e-5), name


def _accumulation(microbatches, use_no_sync):
    """K microbatches per step (with or without no_sync) for every strategy."""
    results = {}
    for strategy in range(4):
        model, optimizer = _wrap(strategy, True)
        if not use_no_sync:
            model.no_sync = lambda: models._null()
        results[strategy] = models.train_sharded(model, optimizer, NUM_STEPS, microbatches=microbatches)
    return results


@pytest.mark.parametrize("world_size", [3])
def test_gradient_accumulation_equals_one_big_batch(world_size):
    reference, _ = models.reference_losses(NUM_STEPS)
    for use_no_sync in (True, False):
        # 4 microbatches of one sample per rank; without no_sync, strategies 0-1 reduce every microbatch and
        # must still count each gradient once
        results = run_on_ranks(world_size, _accumulation, 4, use_no_sync)[0]
        for strategy, losses in results.items():
            assert losses == pytest.approx(reference, abs=1e-5), (strategy, use_no_sync)

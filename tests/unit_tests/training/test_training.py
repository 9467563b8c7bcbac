"""`pretrain()` in-process on ranks: the reported loss is the same on every rank, and SIGTERM on one rank makes
all ranks save a checkpoint at the same iteration and stop."""

import json
import math
import os
import signal

import pytest
import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks

TINY_GPT = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 8 --lr 1e-3 --mock-data --vocab-size 127 --make-vocab-size-divisible-by 64 "
    "--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --log-interval 1 --eval-iters 0 --ckpt-format torch"
)


def _reported_loss_on_ranks(pipeline_size):
    from megatron.core import parallel_state
    from megatron.training.training import reduce_reported_loss

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pipeline_size)
    rank = torch.distributed.get_rank()
    # Two microbatches: [loss sum, token count]; only the last stage has them.
    reports = [{"lm loss": torch.tensor([10.0 + rank, 4.0])}, {"lm loss": torch.tensor([2.0 * rank, 2.0])}]
    if not parallel_state.is_pipeline_last_stage():
        reports = []
    return reduce_reported_loss(reports, torch.device("cpu"))


def _reported_loss_without_tokens():
    from megatron.core import parallel_state
    from megatron.training.training import reduce_reported_loss

    parallel_state.initialize_model_parallel()
    reports = [{"lm loss": torch.tensor([0.0, 0.0])}] * 2  # every token of both microbatches masked, on both ranks
    return reduce_reported_loss(reports, torch.device("cpu"), without_tokens=None), math.isnan(
        reduce_reported_loss(reports, torch.device("cpu")))


@pytest.mark.parametrize("world_size", [2])
def test_reported_loss_of_a_fully_masked_batch_is_no_value_not_zero(world_size):
    # train_step asks for None (no loss this iteration); evaluation keeps NaN.
    assert run_on_ranks(world_size, _reported_loss_without_tokens) == [(None, True)] * 2


@pytest.mark.parametrize("world_size", [2])
def test_reported_loss_is_token_weighted_over_data_parallel_ranks(world_size):
    # DP=2: (10 + 0 + 11 + 2) / (4 + 2 + 4 + 2).
    assert run_on_ranks(world_size, _reported_loss_on_ranks, 1) == [23.0 / 12.0] * 2
    # PP=2: the last stage (rank 1) holds (11 + 2) / 6 and every rank reports it.
    assert run_on_ranks(world_size, _reported_loss_on_ranks, 2) == [13.0 / 6.0] * 2


def _pretrain_until_sigterm(workdir, extra_args, signal_name="SIGTERM"):
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.checkpointing import read_tracker
    from megatron.training.global_vars import get_args
    from megatron.training.training import pretrain

    rank = torch.distributed.get_rank()
    calls = {"count": 0}

    def forward_step_sending_sigterm(data_iterator, model):
        calls["count"] += 1
        # Rank 0 only, during iteration 3 (microbatches per rank: 8 / (2 x DP)).
        microbatches = 8 // (2 * get_args().data_parallel_size)
        if rank == 0 and calls["count"] == 2 * microbatches + 1:
            os.kill(os.getpid(), signal.Signals[signal_name])
        return pretrain_gpt.forward_step(data_iterator, model)

    argv = (
        f"{TINY_GPT} --train-iters 6 --save {workdir} --metrics-file {workdir}/metrics.jsonl {extra_args}"
    ).split()
    iteration = pretrain(
        pretrain_gpt.train_valid_test_datasets_provider,
        pretrain_gpt.model_provider,
        ModelType.encoder_or_decoder,
        forward_step_sending_sigterm,
        argv=argv,
    )
    handler_restored = signal.getsignal(signal.Signals[signal_name]) is signal.SIG_DFL
    return {"iteration": iteration, "tracker": read_tracker(workdir), "handler_restored": handler_restored}


@pytest.mark.parametrize("world_size", [2])
def test_sigterm_saves_and_stops_every_rank(tmp_path, world_size):
    results = run_on_ranks(world_size, _pretrain_until_sigterm, str(tmp_path), "--exit-signal-handler")
    assert results == [{"iteration": 3, "tracker": 3, "handler_restored": True}] * 2
    assert sorted(os.listdir(tmp_path / "iter_0000003")) == ["mp_rank_00"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [record["iteration"] for record in records] == [1, 2, 3]
    assert all(record["consumed-samples"] == 8 * record["iteration"] for record in records)


@pytest.mark.parametrize("world_size", [2])
def test_exit_signal_chooses_the_signal_that_saves_and_stops(tmp_path, world_size):
    results = run_on_ranks(world_size, _pretrain_until_sigterm, str(tmp_path),
                           "--exit-signal-handler --exit-signal SIGUSR1", "SIGUSR1")
    assert results == [{"iteration": 3, "tracker": 3, "handler_restored": True}] * 2


def _moe_aux_losses_logged(workdir, rerun_mode):
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    metrics = f"{workdir}/{rerun_mode}.jsonl"
    argv = (f"{TINY_GPT} --train-iters 2 --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 "
            f"--moe-router-load-balancing-type seq_aux_loss global_aux_loss --moe-aux-loss-coeff 0.01 0.02 "
            f"--moe-z-loss-coeff 1e-3 --rerun-mode {rerun_mode} --metrics-file {metrics}").split()
    pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
             ModelType.encoder_or_decoder, pretrain_gpt.forward_step, argv=argv)
    return [json.loads(line) for line in open(metrics).read().splitlines()]


@pytest.mark.parametrize("world_size", [1])
def test_moe_aux_losses_are_logged_once_when_report_stats_reruns_each_iteration(tmp_path, world_size):
    # report_stats runs every forward-backward pass twice; the aux losses logged are those of one pass.
    once = run_on_ranks(world_size, _moe_aux_losses_logged, str(tmp_path), "validate_results")[0]
    twice = run_on_ranks(world_size, _moe_aux_losses_logged, str(tmp_path), "report_stats")[0]
    names = ("seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")
    assert len(once) == len(twice) == 2
    for plain, rerun in zip(once, twice):
        for name in names:
            assert plain[name] > 0
            assert rerun[name] == pytest.approx(plain[name], rel=1e-6), (name, plain, rerun)


def test_evaluation_steps_run_untimed_and_the_training_timers_come_back(monkeypatch):
    """As upstream, evaluate() runs its forward steps with the chunks' config timers off, so the schedule's level-2
    timers (forward-compute, pipeline transfers) of the next training log line hold training steps only."""
    import argparse
    import dataclasses

    from megatron.training import evaluation, training

    @dataclasses.dataclass(frozen=True)
    class Config:
        timers: object = None

    seen = []

    def run_schedule(forward_step_func, data_iterator, model, args, forward_only, num_microbatches):
        seen.append([chunk.config.timers for chunk in model])
        return [{"lm loss": torch.tensor([3.0, 1.0])}]

    monkeypatch.setattr(evaluation, "run_schedule", run_schedule)
    monkeypatch.setattr(evaluation, "reduce_reported_loss", lambda reports, device: training._loss_sums(reports,
                                                                                                        device))
    monkeypatch.setattr(evaluation, "pause_result_validation", lambda: None)
    monkeypatch.setattr(evaluation, "resume_result_validation", lambda mode: None)
    timers = object()
    model = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    for chunk in model:
        chunk.config = Config(timers=timers)
    args = argparse.Namespace(eval_iters=3, device=torch.device("cpu"), empty_unused_memory_level=0,
                              global_batch_size=4, micro_batch_size=1, data_parallel_size=2)
    losses = training.evaluate(None, None, model, model[0].config, args)
    assert seen == [[None, None]] * 3
    assert torch.equal(losses["lm loss"], torch.tensor([9.0, 3.0], dtype=torch.float64))
    assert [chunk.config.timers for chunk in model] == [timers, timers] and all(chunk.training for chunk in model)

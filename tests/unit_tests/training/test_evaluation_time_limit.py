"""--exit-duration-in-mins reached during an evaluation: as upstream, the evaluation stops on every rank, its loss
over part of the batches is not reported (log line, metrics file, TensorBoard), and the run saves and exits."""

import contextlib
import io
import json
import os

import torch

from megatron.training import run_control
from tests.unit_tests.multiprocess_harness import run_on_ranks

TINY_GPT = (
    "--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 8 --lr 1e-3 --mock-data --vocab-size 127 --make-vocab-size-divisible-by 64 "
    "--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --log-interval 1 --ckpt-format torch "
    "--train-iters 6 --eval-interval 2 --eval-iters 3 --exit-duration-in-mins 1"
)


def _pretrain_past_the_limit_during_evaluation(workdir):
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training import training
    from megatron.training.checkpointing import read_tracker

    rank = torch.distributed.get_rank()
    forwards = {"count": 0}
    real_clock = run_control.ExitDuration.clock

    def forward_step(data_iterator, model):
        forwards["count"] += 1
        # 2 microbatches per global batch on each of the 2 data-parallel ranks: forwards 1-4 train iterations 1
        # and 2, forward 5 is the first of the evaluation at iteration 2. Rank 0's clock jumps past the limit there.
        if rank == 0 and forwards["count"] == 5:
            run_control.ExitDuration.clock = staticmethod(lambda: real_clock() + 120.0)
        return pretrain_gpt.forward_step(data_iterator, model)

    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            iteration = training.pretrain(
                pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                ModelType.encoder_or_decoder, forward_step,
                argv=f"{TINY_GPT} --save {workdir} --metrics-file {workdir}/metrics.jsonl".split())
    finally:
        run_control.ExitDuration.clock = staticmethod(real_clock)
    return {"iteration": iteration, "tracker": read_tracker(workdir), "forwards": forwards["count"],
            "stdout": stdout.getvalue()}


def test_an_evaluation_cut_short_by_the_time_limit_is_not_reported(tmp_path):
    results = run_on_ranks(2, _pretrain_past_the_limit_during_evaluation, str(tmp_path))
    # Both ranks stop after the evaluation's first batch (forwards 5 and 6), save iteration 2 and exit.
    assert [(r["iteration"], r["tracker"], r["forwards"]) for r in results] == [(2, 2, 6)] * 2
    logged = results[1]["stdout"]  # the last rank prints the log
    assert "iteration 2/ 6 |" in logged and "validation loss" not in logged
    assert ("evaluation stopped after 1 of 3 batches: reached --exit-duration-in-mins 1; its loss is not reported"
            in results[0]["stdout"])
    records = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
    assert [(record["iteration"], record["split"]) for record in records] == [(1, "train"), (2, "train")]

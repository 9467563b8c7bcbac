"""A --rampup-batch-size ramp whose steps do not split into microbatches trains under
--decrease-batch-size-if-needed, each step running (and counting) the largest multiple below its size."""

import torch


def _pretrain_with_decreased_rampup(workdir):
    import json

    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    calls = {"forward": 0}

    def counting_forward_step(data_iterator, model):
        calls["forward"] += 1
        return pretrain_gpt.forward_step(data_iterator, model)

    argv = ("--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
            "--global-batch-size 24 --rampup-batch-size 6 6 36 --decrease-batch-size-if-needed --train-samples 100 "
            "--lr 1e-3 --mock-data --vocab-size 127 --make-vocab-size-divisible-by 64 --hidden-dropout 0 "
            f"--attention-dropout 0 --num-workers 0 --log-interval 1 --eval-iters 0 "
            f"--metrics-file {workdir}/metrics.jsonl").split()
    iteration = pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                         ModelType.encoder_or_decoder, counting_forward_step, argv=argv)
    records = []
    if torch.distributed.get_rank() == 1:
        records = [json.loads(line) for line in open(f"{workdir}/metrics.jsonl")]
    return iteration, calls["forward"], [r["consumed-samples"] for r in records]


def test_decreased_rampup_in_training(tmp_path):
    from tests.unit_tests.multiprocess_harness import run_on_ranks

    results = run_on_ranks(2, _pretrain_with_decreased_rampup, str(tmp_path))
    # 4 samples per microbatch step (mbs 2 x DP 2); ramp 6, 12, 18, 24 (one increment per 12 samples) runs as
    # 4, 4, 4, 12, 16 while at most 36 samples are consumed, then (100 - 40) // 24 = 2 batches of 24.
    runs = [4, 4, 4, 12, 16, 24, 24]
    assert [result[:2] for result in results] == [(7, sum(runs) // 4)] * 2
    consumed = [sum(runs[: i + 1]) for i in range(len(runs))]
    assert results[1][2] == consumed

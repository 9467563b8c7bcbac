"""Sample-based training (--train-samples, --lr-*-samples), the WSD schedule and decoupled learning rates:
the learning rate of every iteration against the formulas written out here, and upstream's rules."""

import math

import pytest
import torch

from megatron.core.optimizer import OptimizerConfig, get_param_groups
from megatron.training.arguments import parse_args, validate_args
from megatron.training.model_setup import build_scheduler

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--global-batch-size 8 --lr 1e-3 --min-lr 1e-4 --mock-data --vocab-size 128")


@pytest.fixture(autouse=True)
def single_process_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")


def validated(extra):
    return validate_args(parse_args(args=(BASE + " " + extra).split()))


def _toy_groups(args):
    """Two weights: one marked as the word embedding (as GPTModel marks it), one not."""
    module = torch.nn.Module()
    module.embedding = torch.nn.Parameter(torch.ones(4, 2))
    module.embedding.is_embedding_or_output_parameter = True
    module.hidden = torch.nn.Parameter(torch.ones(2, 2))
    config = OptimizerConfig(lr=args.lr, min_lr=args.min_lr, decoupled_lr=args.decoupled_lr,
                             decoupled_min_lr=args.decoupled_min_lr, weight_decay=0.0)
    return module, get_param_groups([module], config)


def _lrs_per_iteration(args):
    """[(lr of the plain group, lr of the embedding group)] after 0, 1, ..., train_iters optimizer steps."""
    module, groups = _toy_groups(args)
    optimizer = torch.optim.SGD(groups, lr=args.lr)
    scheduler = build_scheduler(optimizer, args)

    def lrs():
        by_param = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
        return by_param[id(module.hidden)], by_param[id(module.embedding)]

    values = [lrs()]
    for _ in range(args.train_iters):
        scheduler.step(increment=args.global_batch_size)
        values.append(lrs())
    return values


def _cosine(samples, max_lr, min_lr, warmup, decay):
    if samples <= warmup:
        return max_lr * samples / warmup
    if samples > decay:
        return min_lr
    ratio = (samples - warmup) / (decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1) * (max_lr - min_lr)


def test_sample_based_cosine_schedule_with_decoupled_lr():
    args = validated("--train-samples 100 --lr-decay-samples 80 --lr-warmup-samples 20 --lr-decay-style cosine "
                     "--decoupled-lr 5e-3 --decoupled-min-lr 4e-4")
    assert args.train_iters == 100 // 8
    lrs = _lrs_per_iteration(args)
    for iteration, (plain, embedding) in enumerate(lrs):
        samples = 8 * iteration
        assert plain == pytest.approx(_cosine(samples, 1e-3, 1e-4, 20, 80), rel=1e-12, abs=1e-15)
        assert embedding == pytest.approx(_cosine(samples, 5e-3, 4e-4, 20, 80), rel=1e-12, abs=1e-15)
    assert lrs[-1] == (1e-4, 4e-4)  # past --lr-decay-samples: the minimum of each


def test_decoupled_lr_moves_only_the_embedding_by_its_rate():
    args = validated("--train-samples 80 --lr-decay-style constant --decoupled-lr 5e-3 --weight-decay 0")
    module, groups = _toy_groups(args)
    optimizer = torch.optim.SGD(groups, lr=args.lr)
    build_scheduler(optimizer, args)
    for param in (module.embedding, module.hidden):
        param.grad = torch.full_like(param, 2.0)
    optimizer.step()
    # fp32 parameters: one rounding of the update (ulp 6e-8 near 1).
    torch.testing.assert_close(module.embedding.detach(), torch.full((4, 2), 1.0 - 5e-3 * 2.0), rtol=0, atol=1e-7)
    torch.testing.assert_close(module.hidden.detach(), torch.full((2, 2), 1.0 - 1e-3 * 2.0), rtol=0, atol=1e-7)
    # --decoupled-min-lr defaults to --min-lr.
    assert [group.get("min_lr") for group in groups] == [None, 1e-4]


def _wsd_coefficient(style, ratio):
    return {"exponential": 2.0 * 0.5**ratio - 1.0, "linear": 1.0 - ratio,
            "cosine": 0.5 * (math.cos(math.pi * ratio) + 1.0), "minus_sqrt": 1.0 - math.sqrt(ratio)}[style]


@pytest.mark.parametrize("style", ["exponential", "linear", "cosine", "minus_sqrt"])
@pytest.mark.parametrize("unit", ["samples", "iters"])
def test_wsd_schedule(style, unit):
    # 12 iterations of 8 samples; warm-up 2 iterations, stable, then the last 5 iterations anneal.
    if unit == "samples":
        extra = "--train-samples 96 --lr-warmup-samples 16 --lr-wsd-decay-samples 40"
    else:
        extra = "--train-iters 12 --lr-warmup-iters 2 --lr-wsd-decay-iters 5"
    args = validated(f"{extra} --lr-decay-style WSD --lr-wsd-decay-style {style}")
    for iteration, (plain, _) in enumerate(_lrs_per_iteration(args)):
        samples = 8 * iteration
        if samples <= 16:
            expected = 1e-3 * samples / 16
        elif samples <= 96 - 40:
            expected = 1e-3
        else:
            expected = 1e-4 + _wsd_coefficient(style, (samples - 56) / 40) * (1e-3 - 1e-4)
        assert plain == pytest.approx(expected, rel=1e-12, abs=1e-15), iteration


def test_warmup_fraction_counts_decay_samples():
    args = validated("--train-samples 100 --lr-warmup-fraction 0.25")
    assert (args.lr_decay_samples, args.lr_warmup_samples) == (100, 25)
    assert args.lr_schedule_samples.weight_decay_increment == 100


def test_warmup_fraction_of_samples_is_not_rounded():
    args = validated("--train-samples 30 --lr-warmup-fraction 0.13")
    assert args.lr_schedule_samples.warmup == pytest.approx(0.13 * 30)


@pytest.mark.parametrize("extra, message", [
    ("--train-iters 10 --train-samples 80", "--train-iters and --train-samples are exclusive"),
    ("--train-samples 80 --lr-decay-iters 5", "--lr-decay-iters needs iteration-based training"),
    ("--train-samples 80 --lr-warmup-iters 1", "--lr-warmup-iters needs iteration-based training"),
    ("--train-iters 10 --lr-decay-samples 80", "--lr-decay-samples needs sample-based training"),
    ("--train-iters 10 --lr-warmup-samples 8", "--lr-warmup-samples needs sample-based training"),
    ("--train-samples 80 --lr-warmup-samples 8 --lr-warmup-fraction 0.1",
     "--lr-warmup-fraction and --lr-warmup-samples are exclusive"),
    ("--train-samples 80 --lr-warmup-samples 80", "--lr-warmup-samples (80) must be in [0, --lr-decay-samples"),
    ("--train-samples 4", "less than one --global-batch-size"),
    ("--train-samples 80 --lr-decay-style WSD", "--lr-decay-style WSD needs --lr-wsd-decay-samples"),
    ("--train-iters 10 --lr-decay-style WSD", "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    ("--train-iters 10 --lr-wsd-decay-iters 2", "--lr-wsd-decay-iters needs --lr-decay-style WSD"),
    ("--train-iters 10 --lr-wsd-decay-style linear", "--lr-wsd-decay-style needs --lr-decay-style WSD"),
    ("--train-iters 10 --lr-decay-style WSD --lr-wsd-decay-iters 11", "--lr-wsd-decay-iters (11) must be in"),
    ("--train-iters 10 --decoupled-min-lr 1e-4", "--decoupled-min-lr needs --decoupled-lr"),
    ("--train-iters 10 --decoupled-lr 1e-3 --decoupled-min-lr 2e-3", "--decoupled-min-lr (0.002) must be in"),
    ("", "--train-iters (or --train-samples) is required"),
])
def test_schedule_rules(extra, message):
    with pytest.raises(ValueError) as error:
        validated(extra)
    assert message in str(error.value)


def test_decoupled_lr_reaches_gpt_embedding_and_output_layer():
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2)
    model = GPTModel(config, vocab_size=32, max_sequence_length=8, share_embeddings_and_output_weights=False)
    groups = get_param_groups([model], OptimizerConfig(lr=1e-3, min_lr=0.0, decoupled_lr=5e-3))
    decoupled = [id(p) for group in groups if group.get("max_lr") == 5e-3 for p in group["params"]]
    assert sorted(decoupled) == sorted([id(model.embedding.word_embeddings.weight), id(model.output_layer.weight)])


def test_rampup_batch_size_steps_and_iteration_count():
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    # 16 = 4 + 3 increments of 4, one every 48 / 3 = 16 samples; 2 samples per microbatch step (mbs 2, DP 1).
    ramp = RampupBatchsizeNumMicroBatchesCalculator(16, 2, 1, 4, 4, 48)
    sizes = {}
    for consumed in (0, 15, 16, 31, 32, 47, 48, 49, 1000):
        ramp.update(consumed)
        sizes[consumed] = (ramp.current_global_batch_size, ramp.num_microbatches)
    assert sizes == {0: (4, 2), 15: (4, 2), 16: (8, 4), 31: (8, 4), 32: (12, 6), 47: (12, 6), 48: (16, 8),
                     49: (16, 8), 1000: (16, 8)}
    # Ramp steps while at most 48 samples are consumed: 4, 4, 4, 4 (16), 8, 8 (32), 12, 12 (56); then
    # (200 - 56) // 16 = 9 full batches.
    args = validated("--global-batch-size 16 --train-samples 200 --rampup-batch-size 4 4 48")
    assert args.rampup_batch_size == (4, 4, 48) and args.train_iters == 8 + 9


def test_rampup_over_zero_samples_runs_the_full_batch_from_the_start():
    """--rampup-batch-size <start> <increment> 0: a ramp over no samples, so every step is a full global batch
    (the ramp's per-increment samples would be 0, a division by zero)."""
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    ramp = RampupBatchsizeNumMicroBatchesCalculator(16, 2, 1, 4, 4, 0)
    for consumed in (0, 1, 16):
        ramp.update(consumed)
        assert (ramp.current_global_batch_size, ramp.num_microbatches) == (16, 8)
    args = validated("--global-batch-size 16 --train-samples 200 --rampup-batch-size 4 4 0")
    assert args.train_iters == 200 // 16


@pytest.mark.parametrize("extra, message", [
    ("--train-iters 10 --rampup-batch-size 2 2 16", "--rampup-batch-size needs sample-based training"),
    ("--train-samples 80 --rampup-batch-size 2 2", "takes three integers"),
    ("--train-samples 80 --rampup-batch-size 6 4 16", "minus the start (6) must be a non-negative multiple"),
    ("--train-samples 80 --rampup-batch-size 0 4 16", "must be positive"),
    ("--train-samples 80 --global-batch-size 12 --rampup-batch-size 3 3 16", "must be multiples of"),
])
def test_rampup_rules(extra, message):
    with pytest.raises(ValueError) as error:
        validate_args(parse_args(args=(BASE.replace("--global-batch-size 8 ", "") + " " + extra).split()))
    assert message in str(error.value)


RAMPUP = ("--global-batch-size 16 --rampup-batch-size 4 4 24 --train-samples 76 --lr-decay-style linear "
          "--lr-warmup-samples 8 --min-lr 1e-4")
# A ramp whose steps (6, 12, 18, 24) do not split into microbatch steps of 4 samples.
DECREASED_RAMPUP = "--global-batch-size 24 --rampup-batch-size 6 6 36 --decrease-batch-size-if-needed --train-samples 100"


def _pretrain_with_rampup(workdir, schedule):
    import json

    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    calls = {"forward": 0}

    def counting_forward_step(data_iterator, model):
        calls["forward"] += 1
        return pretrain_gpt.forward_step(data_iterator, model)

    argv = ("--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
            f"{schedule} --lr 1e-3 --mock-data --vocab-size 127 "
            "--make-vocab-size-divisible-by 64 --hidden-dropout 0 --attention-dropout 0 --num-workers 0 "
            f"--log-interval 1 --eval-iters 0 --metrics-file {workdir}/metrics.jsonl").split()
    iteration = pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                         ModelType.encoder_or_decoder, counting_forward_step, argv=argv)
    records = []
    if torch.distributed.get_rank() == 1:  # the logging rank
        records = [json.loads(line) for line in open(f"{workdir}/metrics.jsonl")]
    return iteration, calls["forward"], [(r["consumed-samples"], r["learning-rate"]) for r in records]


def test_rampup_batch_size_in_training(tmp_path):
    from tests.unit_tests.multiprocess_harness import run_on_ranks

    results = run_on_ranks(2, _pretrain_with_rampup, str(tmp_path), RAMPUP)
    # 4 samples per microbatch step (mbs 2 x DP 2); 16 = 4 + 3 x 4 over 24 samples (one increment per 8):
    # batches 4, 4, 8, 12 while at most 24 samples are consumed, then (76 - 28) // 16 = 3 batches of 16.
    consumed = [4, 8, 16, 28, 44, 60, 76]
    assert [result[:2] for result in results] == [(7, 76 // 4)] * 2  # microbatches per rank: the samples / 4
    logged = results[1][2]
    assert [samples for samples, _ in logged] == consumed
    for samples, lr in logged:  # the schedule counts samples: warm-up 8, linear decay to 76 (--train-samples)
        expected = 1e-3 * samples / 8 if samples <= 8 else 1e-4 + (1 - (samples - 8) / (76 - 8)) * (1e-3 - 1e-4)
        assert lr == pytest.approx(expected, rel=1e-12), samples


def test_decreased_rampup_in_training(tmp_path):
    """--decrease-batch-size-if-needed: each ramp step runs (and counts) the largest multiple of 4 below it."""
    from tests.unit_tests.multiprocess_harness import run_on_ranks

    results = run_on_ranks(2, _pretrain_with_rampup, str(tmp_path), DECREASED_RAMPUP)
    # 4 samples per microbatch step (mbs 2 x DP 2); ramp 6, 12, 18, 24 (one increment per 12 samples) runs as
    # 4, 4, 4, 12, 16 while at most 36 samples are consumed, then (100 - 40) // 24 = 2 batches of 24.
    runs = [4, 4, 4, 12, 16, 24, 24]
    assert [result[:2] for result in results] == [(7, sum(runs) // 4)] * 2
    assert [samples for samples, _ in results[1][2]] == [sum(runs[: i + 1]) for i in range(len(runs))]

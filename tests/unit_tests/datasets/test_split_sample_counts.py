"""The number of samples each split is built with, from --train-iters / --train-samples, --eval-iters and
--eval-interval, as upstream's train_valid_test_num_samples."""

import pytest

from megatron.training.arguments import parse_args, validate_args
from megatron.training.data_iterators import dataset_sample_counts

BASE = ("--num-layers 1 --hidden-size 8 --num-attention-heads 2 --seq-length 8 --max-position-embeddings 8 "
        "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --mock-data --vocab-size 64 --eval-interval 5 "
        "--eval-iters 2")


@pytest.mark.parametrize("length, expected", [
    # 12 iterations of 4 samples; validation after iterations 5 and 10 and at the end: 3 x 2 x 4; test: 2 x 4.
    ("--train-iters 12", [48, 24, 8]),
    # --train-samples is the training split's size, not a whole number of global batches (50 // 4 = 12 iterations).
    ("--train-samples 50", [50, 24, 8]),
    # A batch-size ramp: 2 for the first 16 samples (8 iterations), then 4 (8 more); 16 iterations, still 50.
    ("--train-samples 50 --rampup-batch-size 2 2 16", [50, 32, 8]),
])
def test_split_sample_counts_follow_the_training_length(length, expected, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    args = validate_args(parse_args(args=f"{BASE} {length}".split()))
    assert dataset_sample_counts(args) == expected

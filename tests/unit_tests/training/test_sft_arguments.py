"""`--sft` flags: the prompt format's default and check, and the combinations that stop naming what to do."""

import pytest

from tests.unit_tests.training import argument_checks

SFT = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 "
       "--train-iters 10 --lr 1e-3 --data-path chat.jsonl --tokenizer-type ByteLevelTokenizer --sft")


def validated(extra=""):
    return argument_checks.validated(extra, base=SFT)


def test_defaults():
    args = validated()
    assert args.sft and args.sft_packing and args.sft_tokenizer_prompt_format == "chatml"
    args = validated("--sft-tokenizer-prompt-format llama3 --no-sft-packing --micro-batch-size 4")
    assert not args.sft_packing and args.sft_tokenizer_prompt_format == "llama3" and args.micro_batch_size == 4


@pytest.mark.parametrize("extra, base, message", [
    ("--micro-batch-size 2", SFT, r"needs --micro-batch-size 1 \(got 2; .* or give --no-sft-packing"),
    ("--sft-tokenizer-prompt-format nemotron-h-aligned", SFT, r"'nemotron-h-aligned' is not one of chatml, llama3"),
    ("--reset-position-ids", SFT, r"--reset-position-ids shapes pretraining samples; .* drop --reset-position-ids"),
    ("--eod-mask-loss", SFT, r"drop --eod-mask-loss"),
    ("--tokenizer-type NullTokenizer --vocab-size 64", SFT, r"--tokenizer-type NullTokenizer cannot tokenize"),
    ("--mock-data", SFT.replace("--data-path chat.jsonl ", ""), r"instead of --mock-data"),
    ("--no-sft-packing", argument_checks.BASE, r"--no-sft-packing sets up supervised fine-tuning data: add --sft"),
    ("--sft-tokenizer-prompt-format plain", argument_checks.BASE, r"--sft-tokenizer-prompt-format sets up"),
])
def test_refused_combinations(extra, base, message):
    with pytest.raises(ValueError, match=message):
        argument_checks.validated(extra, base=base)


def test_upstream_sft_tokenizer_type_needs_its_tokenizer_model():
    args = validated("--tokenizer-type SFTTokenizer --tokenizer-model some/dir --trust-remote-code")
    assert args.tokenizer_type == "SFTTokenizer" and args.trust_remote_code
    with pytest.raises(ValueError, match=r"--tokenizer-type SFTTokenizer needs --tokenizer-model"):
        validated("--tokenizer-type SFTTokenizer")

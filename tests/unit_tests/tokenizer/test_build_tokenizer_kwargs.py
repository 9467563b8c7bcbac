"""Upstream's `build_tokenizer(args, **kwargs)`: the keywords go to HuggingFaceTokenizer's
`transformers.AutoTokenizer.from_pretrained`; the other types, and a bare tokenizer.json, refuse them by name.
Upstream's `--tokenizer-hf-use-fast` and `--tokenizer-hf-include-special-tokens` launch flags."""

import argparse

import pytest

from megatron.training.tokenizer import build_tokenizer, build_tokenizer_from_args
from megatron.training.tokenizer.bpe_training import save_bpe_tokenizer, train_bpe_tokenizer
from tests.unit_tests.tokenizer.test_upstream_parity import CORPUS, _save_llama3_like_directory
from tests.unit_tests.training.argument_checks import validated

transformers = pytest.importorskip("transformers")


def _args(**flags):
    defaults = dict(rank=1, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, vocab_size=None,
                    vocab_file=None, merge_file=None, tokenizer_model=None)
    return argparse.Namespace(**{**defaults, **flags})


def test_keywords_reach_auto_tokenizer_from_pretrained(tmp_path):
    _save_llama3_like_directory(tmp_path)
    args = _args(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    tokenizer = build_tokenizer(args, padding_side="left", model_max_length=77)
    pretrained = tokenizer.backend.pretrained
    assert (pretrained.padding_side, pretrained.model_max_length) == ("left", 77)
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path)).padding_side == "right"
    assert tokenizer.unique_identifiers["padding_side"] == "left"
    assert tokenizer.unique_identifiers["model_max_length"] == "77"
    assert args.padded_vocab_size == 384
    named = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path), padding_side="left")
    assert named.backend.pretrained.padding_side == "left"


def test_keywords_for_other_types_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="padding_side .*--tokenizer-type NullTokenizer takes none"):
        build_tokenizer(_args(tokenizer_type="NullTokenizer", vocab_size=10), padding_side="left")
    with pytest.raises(TypeError, match="reads trust_remote_code from args"):
        build_tokenizer(_args(tokenizer_type="NullTokenizer", vocab_size=10), trust_remote_code=True)
    save_bpe_tokenizer(train_bpe_tokenizer(CORPUS, vocab_size=300, min_frequency=1), str(tmp_path))
    with pytest.raises(ValueError, match="bare tokenizer.json.*padding_side"):
        build_tokenizer(_args(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tokenizer.json")),
                        padding_side="left")


def test_upstream_hf_flags_are_taken(tmp_path):
    _save_llama3_like_directory(tmp_path)
    args = validated(f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tmp_path} --tokenizer-hf-use-fast "
                     "--tokenizer-hf-include-special-tokens")
    assert args.tokenizer_hf_use_fast and args.tokenizer_hf_include_special_tokens
    tokenizer = build_tokenizer_from_args(args)
    assert tokenizer.unique_identifiers["use_fast"] == "True"
    assert tokenizer.tokenize("Hello")[0] == tokenizer.bos == 1  # the special tokens the tokenizer adds
    plain = build_tokenizer_from_args(validated(f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tmp_path}"))
    assert "use_fast" not in plain.unique_identifiers and plain.tokenize("Hello") == tokenizer.tokenize("Hello")

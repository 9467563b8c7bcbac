"""The tokenizer interface upstream scripts use: `build_tokenizer(args)` with its start-up lines and
`args.padded_vocab_size`, `_vocab_size_with_padding`, and the attributes of upstream's `MegatronTokenizer`
(`unique_identifiers`, `vocab` / `inv_vocab`, `offsets`, `eos`, `cls` / `sep` / `mask`) for each family."""

import argparse
import json

import pytest

from megatron.training.tokenizer import build_tokenizer
from megatron.training.tokenizer.bpe_training import save_bpe_tokenizer, train_bpe_tokenizer
from megatron.training.tokenizer.tokenizer import _vocab_size_with_padding
from tests.unit_tests.tokenizer.test_upstream_parity import CORPUS, TEXTS, _save_llama3_like_directory

transformers = pytest.importorskip("transformers")

EDGE_TEXTS = TEXTS + ["\u200b\u00a0x", "e\u0301", "<|endoftext|>", "\t\t", "\r\n\r\n", "a\u2028b",
                      "\U0001f469\u200d\U0001f4bb"]


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bpe")
    save_bpe_tokenizer(train_bpe_tokenizer(CORPUS, vocab_size=300, min_frequency=1), str(directory))
    return {name: str(directory / name) for name in ("vocab.json", "merges.txt", "tokenizer.json")}


def _upstream_args(**flags):
    defaults = dict(rank=0, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, vocab_size=None,
                    vocab_file=None, merge_file=None, tokenizer_model=None)
    return argparse.Namespace(**{**defaults, **flags})


def _upstream_offsets(reference, ids, text):
    """Upstream HuggingFaceTokenizer.offsets."""
    encoding, offsets, next_start = reference(text), [], 0
    for index in range(len(ids)):
        span = encoding.token_to_chars(index)
        if span is None:
            offsets.append(next_start)
        else:
            offsets.append(span.start)
            next_start = span.end
    return offsets


def test_build_tokenizer_takes_upstreams_args(bpe_files, capsys):
    args = _upstream_args(tokenizer_type="GPT2BPETokenizer", vocab_file=bpe_files["vocab.json"],
                          merge_file=bpe_files["merges.txt"], tensor_model_parallel_size=2)
    tokenizer = build_tokenizer(args)
    assert tokenizer.vocab_size == 300 and args.padded_vocab_size == 512
    assert capsys.readouterr().out == ("> building GPT2BPETokenizer tokenizer ...\n"
                                       " > padded vocab (size: 300) with 212 dummy tokens (new size: 512)\n")
    quiet = _upstream_args(tokenizer_type="NullTokenizer", vocab_size=1000, rank=1)
    assert build_tokenizer(quiet).eod == 1000 and quiet.padded_vocab_size == 1024
    assert capsys.readouterr().out == ""


def test_vocab_size_with_padding_is_upstreams(capsys):
    args = _upstream_args(tensor_model_parallel_size=2)
    assert _vocab_size_with_padding(50257, args) == 50432
    assert capsys.readouterr().out == " > padded vocab (size: 50257) with 175 dummy tokens (new size: 50432)\n"
    assert _vocab_size_with_padding(50257, args, logging_enabled=False) == 50432
    assert _vocab_size_with_padding(256, _upstream_args(rank=3)) == 256
    assert capsys.readouterr().out == ""


def test_upstream_class_names_import():
    from megatron.training.tokenizer import GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer
    from megatron.training.tokenizer.tiktoken_tokenizer import TikTokenizer
    from megatron.training.tokenizer.tokenizer import (
        CustomTikTokenizer,
        _GPT2BPETokenizer,
        _HuggingFaceTokenizer,
        _NullTokenizer,
    )

    assert (_NullTokenizer, _GPT2BPETokenizer, _HuggingFaceTokenizer, CustomTikTokenizer) == (
        NullTokenizer, GPT2BPETokenizer, HuggingFaceTokenizer, TikTokenizer)


def test_null_tokenizer_attributes_are_upstreams():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=1000)
    assert (tokenizer.cls, tokenizer.sep, tokenizer.mask, tokenizer.additional_special_tokens_ids) == (-1, -1, -1, None)
    ids = [5, 17, 999, 1000]
    text = tokenizer.detokenize(ids)
    assert tokenizer.offsets(ids, text) == [0, 2, 5, 9]
    assert [text[start:].split(" ")[0] for start in tokenizer.offsets(ids, text)] == ["5", "17", "999", "1000"]
    assert tokenizer.unique_identifiers == {"class": "NullTokenizer", "tokenizer_path": [None], "vocab_size": "1000"}
    assert json.loads(tokenizer.unique_description) == tokenizer.unique_identifiers
    for attribute in ("vocab", "inv_vocab", "eos"):
        with pytest.raises(NotImplementedError, match=f"NullTokenizer has no attribute '{attribute}'"):
            getattr(tokenizer, attribute)


def test_gpt2_bpe_vocab_offsets_and_identifiers(bpe_files):
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=bpe_files["vocab.json"],
                                merge_file=bpe_files["merges.txt"])
    with open(bpe_files["vocab.json"], encoding="utf-8") as handle:
        vocab = json.load(handle)
    assert tokenizer.vocab == tokenizer.encoder == vocab
    assert tokenizer.inv_vocab == tokenizer.decoder == {token_id: token for token, token_id in vocab.items()}
    assert tokenizer.unique_identifiers == {"class": "GPT2BPETokenizer",
                                            "tokenizer_path": [bpe_files["vocab.json"], bpe_files["merges.txt"]]}
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=bpe_files["tokenizer.json"])
    for text in EDGE_TEXTS:
        ids = tokenizer.tokenize(text)
        assert tokenizer.detokenize(ids) == text, repr(text)
        if "<|endoftext|>" not in text:  # an added token of tokenizer.json, ordinary text to vocab.json + merges.txt
            assert ids == reference(text).input_ids, repr(text)
            assert tokenizer.offsets(ids, text) == _upstream_offsets(reference, ids, text), repr(text)
    text = "Hello world! It's a test"
    ids = tokenizer.tokenize(text)
    pieces = [tokenizer.detokenize([token]) for token in ids]
    assert tokenizer.offsets(ids, text) == [sum(map(len, pieces[:index])) for index in range(len(ids))]


def test_huggingface_directory_attributes_are_auto_tokenizers(tmp_path):
    _save_llama3_like_directory(tmp_path)
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert (tokenizer.eos, tokenizer.eod) == (reference.eos_token_id, reference.eos_token_id)
    assert tokenizer.vocab == reference.get_vocab() and len(tokenizer.vocab) == tokenizer.vocab_size
    assert tokenizer.inv_vocab[tokenizer.bos] == "<|begin_of_text|>" == tokenizer.decoder[tokenizer.bos]
    assert tokenizer.unique_identifiers == {"class": "HuggingFaceTokenizer", "tokenizer_path": [str(tmp_path)],
                                            "trust_remote_code": "False"}
    for text in EDGE_TEXTS:
        ids = tokenizer.tokenize(text)
        assert ids[0] == tokenizer.bos  # the tokenizer's post-processor adds it, as upstream's tokenize keeps
        assert tokenizer.detokenize(ids[1:]) == text, repr(text)
        assert tokenizer.detokenize(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
        if text != "<|endoftext|>":  # a special token of this tokenizer
            assert tokenizer.detokenize(ids, skip_special_tokens=True) == text, repr(text)
        assert tokenizer.offsets(ids, text) == _upstream_offsets(reference, ids, text), repr(text)


def test_bare_tokenizer_json_round_trips_edge_texts(bpe_files):
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=bpe_files["tokenizer.json"])
    assert tokenizer.eos == tokenizer.eod == tokenizer.vocab["<|endoftext|>"]
    for text in EDGE_TEXTS:
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text, repr(text)

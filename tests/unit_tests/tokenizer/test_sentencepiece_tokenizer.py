"""Upstream's SentencePiece types (`SentencePieceTokenizer`, `GPTSentencePieceTokenizer`, `Llama2Tokenizer`) over a
tiny `.model` trained here: their ids against `sentencepiece` itself, upstream's added special tokens and
`--vocab-extra-ids`, the launch flags, and the message when the package is missing."""

import io
import sys

import pytest

from megatron.training.tokenizer import build_tokenizer, build_tokenizer_from_args
from tests.unit_tests.tokenizer.test_upstream_parity import CORPUS
from tests.unit_tests.training.argument_checks import validated


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    sentencepiece = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    # Its ids: <unk> 0, <s> 1, </s> 2 (bos and eos), no pad piece; then 77 BPE pieces.
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_writer=model, vocab_size=80,
                                             model_type="bpe", hard_vocab_limit=False, minloglevel=2)
    path = tmp_path_factory.mktemp("sentencepiece") / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return str(path)


def test_sentencepiece_tokenizer_appends_upstreams_special_tokens(model_file):
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model_file, vocab_extra_ids=2)
    pieces = tokenizer.tokenizer
    assert len(pieces) == 80
    # <CLS> <SEP> <EOD> <MASK> <PAD> appended; <s> and </s> are the model's; then the two <extra_id_N>.
    assert (tokenizer.cls, tokenizer.sep, tokenizer.eod, tokenizer.mask, tokenizer.pad) == (80, 81, 82, 83, 84)
    assert (tokenizer.bos, tokenizer.eos, tokenizer.vocab_size) == (1, 2, 87)
    assert tokenizer.additional_special_tokens_ids == [85, 86] and tokenizer.inv_vocab[86] == "<extra_id_1>"
    ids = tokenizer.tokenize("Hello world<EOD>It's<extra_id_1>")
    assert ids == pieces.encode("Hello world") + [82] + pieces.encode("It's") + [86]
    assert tokenizer.detokenize(ids) == "Hello world <EOD> It's <extra_id_1> "
    assert tokenizer.offsets(pieces.encode("Hello world"), "Hello world")[-3:] == [8, 9, 10]


def test_gpt_and_llama2_types_keep_the_models_ids(model_file):
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model_file)
    llama = build_tokenizer("Llama2Tokenizer", tokenizer_model=model_file)
    expected = gpt.tokenizer.encode("Hello world! 12345")
    assert gpt.tokenize("Hello world! 12345") == expected and gpt.detokenize(expected) == "Hello world! 12345"
    assert llama.tokenize("Hello world! 12345") == [1] + expected
    assert llama.tokenize("Hello world! 12345", bos=False, eos=True) == expected + [2]
    for tokenizer in (gpt, llama):
        assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.bos, tokenizer.pad) == (80, 2, 1, -1)
        assert (tokenizer.cls, tokenizer.sep, tokenizer.mask) == (-1, -1, -1)


def test_launch_flags_build_them(model_file):
    args = validated(f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {model_file} --vocab-extra-ids 3")
    assert build_tokenizer_from_args(args).vocab_size == 80 + 5 + 3
    assert build_tokenizer_from_args(validated(f"--tokenizer-type Llama2Tokenizer --tokenizer-model {model_file}"))\
        .tokenize("a")[0] == 1
    with pytest.raises(ValueError, match=r"^--tokenizer-type Llama2Tokenizer needs --tokenizer-model \(the "):
        validated("--tokenizer-type Llama2Tokenizer")
    with pytest.raises(ValueError, match=r"--vocab-extra-ids 3 is not supported: --tokenizer-type "
                                         r"GPTSentencePieceTokenizer has no <extra_id_N>"):
        validated(f"--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model {model_file} --vocab-extra-ids 3")


@pytest.mark.parametrize("tokenizer_type", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"])
def test_without_the_package_the_error_says_what_to_install(tokenizer_type, tmp_path, monkeypatch):
    model = tmp_path / "tokenizer.model"
    model.write_bytes(b"\x0a\x01x")
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    with pytest.raises(ImportError, match=rf"^--tokenizer-type {tokenizer_type} reads its --tokenizer-model .model "
                                          r"file with the `sentencepiece` package, which is not installed: pip "
                                          r"install sentencepiece$"):
        build_tokenizer(tokenizer_type, tokenizer_model=str(model))

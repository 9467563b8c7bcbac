"""Tokenizers against the reference implementations upstream Megatron-LM wraps, over tiny vocabularies built here:
GPT2BPETokenizer against `transformers.GPT2Tokenizer` on the same vocab.json / merges.txt, HuggingFaceTokenizer
against `transformers.AutoTokenizer` on the same directory; the SentencePiece types' file errors; upstream's start-up
line."""

import os

import pytest

from megatron.training.tokenizer import build_tokenizer, padded_vocab_message
from megatron.training.tokenizer.bpe_training import save_bpe_tokenizer, train_bpe_tokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

CORPUS = ["Hello world! It's a test, isn't it? We'll see what they've done.",
          "Numbers 12345 and 3.14159, dates 2024-01-01; café naïve 日本語 😀",
          "tabs\tand   runs    of spaces\n\nnew lines\r\n  indented"] * 8

TEXTS = ["Hello world!", "  leading spaces", "trailing   ", "a\n\nb\n", "It's I'M we'll don't they'd",
         "café 日本語 😀 Ω≈ç√", "123 4567 89.0", "x  \t  y", "\n", "", " ", "   \n\n   x", "'s 's'S"]


def test_gpt2_bpe_tokenizes_as_transformers_gpt2_tokenizer(tmp_path):
    save_bpe_tokenizer(train_bpe_tokenizer(CORPUS, vocab_size=330, min_frequency=1), str(tmp_path))
    vocab_file, merge_file = str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    reference = transformers.GPT2Tokenizer(vocab_file, merge_file)
    for text in TEXTS:
        ids = ours.tokenize(text)
        assert ids == reference.encode(text), text
        assert ours.detokenize(ids) == reference.decode(ids) == text
    emoji = ours.tokenize("😀")
    assert len(emoji) > 1 and ours.detokenize(emoji[:1]) == reference.decode(emoji[:1]) == "\ufffd"
    # Upstream: the vocabulary size is vocab.json's, and <|endoftext|> ends a document.
    assert (ours.vocab_size, ours.eod) == (len(reference), reference.convert_tokens_to_ids("<|endoftext|>"))


def _save_llama3_like_directory(directory):
    """A Hugging Face tokenizer directory whose post-processor starts every text with <|begin_of_text|>, whose
    eos_token is <|eot_id|> (while <|endoftext|> is in the vocabulary too), with no pad token, and with one token
    added after the vocabulary."""
    special = ["<|endoftext|>", "<|begin_of_text|>", "<|eot_id|>"]
    backend = train_bpe_tokenizer(CORPUS, vocab_size=300, min_frequency=1, special_tokens=special)
    bos_id = backend.token_to_id("<|begin_of_text|>")
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos_id)])
    pretrained = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>",
                                                      eos_token="<|eot_id|>")
    pretrained.add_tokens(["<tool_call>"])
    pretrained.save_pretrained(str(directory))
    return backend.get_vocab_size(with_added_tokens=True)


def test_huggingface_directory_is_auto_tokenizers(tmp_path):
    base_vocabulary = _save_llama3_like_directory(tmp_path)
    assert os.path.isfile(tmp_path / "tokenizer.json") and os.path.isfile(tmp_path / "tokenizer_config.json")
    ours = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS + ["call <tool_call> now"]:
        ids = ours.tokenize(text)
        assert ids == reference(text).input_ids, text
        assert ids[0] == reference.bos_token_id == 1  # the beginning-of-sequence token upstream's ids start with
        assert ours.detokenize(ids) == reference.decode(ids)
    # Upstream: eod is eos_token_id, bos bos_token_id, vocab_size len(tokenizer) with the added token.
    assert (ours.eod, ours.bos, ours.vocab_size) == (reference.eos_token_id, reference.bos_token_id, len(reference))
    assert (ours.eod, ours.vocab_size) == (2, base_vocabulary + 1)
    assert ours.pad == ours.eod  # no pad token


def test_sentencepiece_types_name_a_missing_model_file():
    for tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        with pytest.raises(FileNotFoundError, match=rf"--tokenizer-type {tokenizer_type} tokenizer from --tokenizer-"
                                                    r"model tokenizer.model: tokenizer.model: no such file.*"
                                                    r"--tokenizer-model a SentencePiece .model file"):
            build_tokenizer(tokenizer_type, tokenizer_model="tokenizer.model")


def test_padded_vocabulary_line_is_upstreams(monkeypatch, capsys):
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.training import set_up_tokenizer_and_microbatches

    assert padded_vocab_message(50257, 50304) == " > padded vocab (size: 50257) with 47 dummy tokens (new size: 50304)"
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    args = validate_args(parse_args(args=(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 "
        "--train-iters 1 --lr 1e-3 --mock-data --vocab-size 1000 --make-vocab-size-divisible-by 128").split()))
    capsys.readouterr()
    try:
        set_up_tokenizer_and_microbatches(args)
    finally:
        destroy_num_microbatches_calculator()
    # NullTokenizer --vocab-size 1000: 1001 ids (the end-of-document id last), padded to 1024 rows.
    assert args.padded_vocab_size == 1024
    assert " > padded vocab (size: 1001) with 23 dummy tokens (new size: 1024)\n" in capsys.readouterr().out

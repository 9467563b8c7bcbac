import json

import pytest

from megatron.training import checkpoint_args
from megatron.training.arguments import parse_args, validate_args
from megatron.training.tokenizer import (
    ByteLevelTokenizer,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    build_tokenizer,
    build_tokenizer_from_args,
    pad_vocab_size,
)
from megatron.training.tokenizer.bpe_training import save_bpe_tokenizer, train_bpe_tokenizer

SAMPLE_TEXTS = [
    "The quick brown fox jumps over the lazy dog.\n",
    "def add(a, b):\n    return a + b  # tabs\tand spaces  \n",
    "Unicode: naïve café, 中文字符, emoji 🙂, Ελληνικά.",
    "",
    "   leading and trailing spaces   ",
]


def test_null_tokenizer():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=1000)
    assert isinstance(tokenizer, NullTokenizer)
    # Upstream's layout: the text ids 0..999, then the end-of-document id 1000.
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.pad) == (1001, 1000, 1000)
    assert tokenizer.tokenize("5 17  999\n3") == [5, 17, 999, 3]
    assert tokenizer.detokenize([5, 17, 999, 3]) == "5 17 999 3"
    assert tokenizer.tokenize(tokenizer.detokenize([0, 999, 42, 1000])) == [0, 999, 42, 1000]
    with pytest.raises(ValueError, match="--vocab-size"):
        tokenizer.tokenize("1001")
    with pytest.raises(ValueError, match="--vocab-size"):
        tokenizer.tokenize("-1")
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")
    with pytest.raises(ValueError, match="--vocab-size of at least 1"):
        build_tokenizer("NullTokenizer", vocab_size=0)
    one_text_id = build_tokenizer("NullTokenizer", vocab_size=1)
    assert (one_text_id.vocab_size, one_text_id.eod, one_text_id.tokenize("0 1")) == (2, 1, [0, 1])


@pytest.mark.parametrize("flags, true_vocab_size, padded_vocab_size", [
    ("--vocab-size 255 --make-vocab-size-divisible-by 64", 256, 256),  # the functional test cases
    ("--vocab-size 256 --make-vocab-size-divisible-by 64", 257, 320),
    ("--vocab-size 1024 --tensor-model-parallel-size 2", 1025, 1280),
])
def test_null_tokenizer_vocabulary_sizes_are_upstreams(flags, true_vocab_size, padded_vocab_size, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    args = validate_args(parse_args(args=(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 "
        "--train-iters 1 --lr 1e-3 --mock-data " + flags).split()))
    tokenizer = build_tokenizer_from_args(args)
    assert (tokenizer.vocab_size, tokenizer.eod) == (true_vocab_size, args.vocab_size)
    assert checkpoint_args.true_vocab_size(args) == true_vocab_size
    assert checkpoint_args.saved_true_vocab_size(None, args) == true_vocab_size
    assert pad_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by,
                          args.tensor_model_parallel_size) == padded_vocab_size


def test_byte_level_tokenizer():
    tokenizer = build_tokenizer("ByteLevelTokenizer")
    assert isinstance(tokenizer, ByteLevelTokenizer)
    assert (tokenizer.vocab_size, tokenizer.eod) == (257, 256)
    assert tokenizer.tokenize("Aé") == [65, 0xC3, 0xA9]
    for text in SAMPLE_TEXTS:
        ids = tokenizer.tokenize(text)
        assert ids == list(text.encode("utf-8"))
        assert tokenizer.detokenize(ids + [tokenizer.eod]) == text


def _bytes_to_unicode():
    """GPT-2's reversible byte -> printable character table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


@pytest.fixture
def tiny_gpt2_files(tmp_path):
    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[byte]: byte for byte in range(256)}
    merges = [("t", "h"), ("th", "e"), ("Ġ", "c"), ("a", "t")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    vocab_file, merge_file = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab_file.write_text(json.dumps(vocab), encoding="utf-8")
    merge_file.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    return str(vocab_file), str(merge_file)


def test_gpt2_bpe_with_tiny_vocab_and_merges(tiny_gpt2_files):
    vocab_file, merge_file = tiny_gpt2_files
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    assert isinstance(tokenizer, GPT2BPETokenizer)
    assert (tokenizer.vocab_size, tokenizer.eod) == (261, 260)
    # "the" -> t,h -> th,e -> the (257); " cat" -> Ġc (258) + at (259); "\n" is byte 10.
    assert tokenizer.tokenize("the cat") == [257, 258, 259]
    assert tokenizer.tokenize("hat\n") == [ord("h"), 259, 10]
    assert tokenizer.tokenize("é") == [0xC3, 0xA9]
    for text in SAMPLE_TEXTS:
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text


def test_gpt2_bpe_missing_file_names_flag(tiny_gpt2_files, tmp_path):
    vocab_file, _ = tiny_gpt2_files
    with pytest.raises(FileNotFoundError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=str(tmp_path / "none.txt"))
    with pytest.raises(ValueError, match="--vocab-file"):
        build_tokenizer("GPT2BPETokenizer", merge_file=vocab_file)


TRAINING_TEXTS = [
    "the tokenizer learns the most frequent pairs of the training text " * 3,
    "parallel training of the model with tensor and pipeline parallelism",
    "data parallel ranks read their own slice of every global batch",
] * 20


def test_locally_trained_bpe_round_trips_and_compresses(tmp_path):
    backend = train_bpe_tokenizer(TRAINING_TEXTS, vocab_size=300)
    path = save_bpe_tokenizer(backend, str(tmp_path / "bpe"))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path)
    assert isinstance(tokenizer, HuggingFaceTokenizer)
    assert tokenizer.vocab_size == 300
    assert tokenizer.eod == 0 and tokenizer.pad == 1  # the special tokens come first
    for text in SAMPLE_TEXTS + TRAINING_TEXTS[:3]:
        ids = tokenizer.tokenize(text)
        assert all(0 <= token < 300 for token in ids)
        assert tokenizer.detokenize(ids) == text
    seen = TRAINING_TEXTS[0]
    assert len(tokenizer.tokenize(seen)) < len(seen.encode("utf-8")) / 3
    # The directory form of --tokenizer-model, and the same model through its vocab/merges files.
    assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "bpe")).tokenize(seen) == (
        tokenizer.tokenize(seen)
    )
    bpe_dir = tmp_path / "bpe"
    as_gpt2 = build_tokenizer(
        "GPT2BPETokenizer", vocab_file=str(bpe_dir / "vocab.json"), merge_file=str(bpe_dir / "merges.txt")
    )
    for text in SAMPLE_TEXTS + TRAINING_TEXTS[:3]:
        assert as_gpt2.tokenize(text) == tokenizer.tokenize(text)
    assert as_gpt2.eod == tokenizer.eod


def test_bpe_training_is_deterministic(tmp_path):
    first = save_bpe_tokenizer(train_bpe_tokenizer(TRAINING_TEXTS, vocab_size=280), str(tmp_path / "a"))
    second = save_bpe_tokenizer(train_bpe_tokenizer(TRAINING_TEXTS, vocab_size=280), str(tmp_path / "b"))
    assert open(first).read() == open(second).read()


def test_huggingface_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer")
    with pytest.raises(FileNotFoundError, match="--tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="--tokenizer-type"):
        build_tokenizer("SentencePieceTokenizer")


@pytest.mark.parametrize(
    "orig,divisible_by,tp,expected",
    [
        (50257, 128, 1, 50304),
        (50257, 128, 2, 50432),
        (257, 128, 1, 384),
        (256, 128, 2, 256),
        (1, 1, 1, 1),
        (1000, 7, 3, 1008),
    ],
)
def test_pad_vocab_size(orig, divisible_by, tp, expected):
    padded = pad_vocab_size(orig, divisible_by, tp)
    assert padded == expected
    assert padded % (divisible_by * tp) == 0 and orig <= padded < orig + divisible_by * tp


def test_pad_vocab_size_rejects_nonsense():
    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by"):
        pad_vocab_size(100, 0, 1)

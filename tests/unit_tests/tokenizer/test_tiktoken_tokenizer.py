"""`TikTokenizer` over a small tiktoken-format vocabulary written here: ids by hand for both pre-tokenizer
patterns, the special-token layout, round trips, vocabulary truncation, the flags and the file checks."""

import base64
import json

import pytest

from megatron.training.arguments import parse_args, validate_args
from megatron.training.tokenizer import build_tokenizer_from_args
from megatron.training.tokenizer.tiktoken_tokenizer import TikTokenizer

pytest.importorskip("tiktoken")

MERGES = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world", b"12", b"123"]
SPECIALS = 10


def write_vocabulary(path, merges=MERGES):
    tokens = [bytes([value]) for value in range(256)] + list(merges)
    entries = [{"rank": rank, "token_bytes": base64.b64encode(token).decode(),
                "token_str": token.decode("utf-8", errors="replace")} for rank, token in enumerate(tokens)]
    path.write_text(json.dumps(entries))
    return str(path)


@pytest.fixture
def vocabulary(tmp_path):
    return write_vocabulary(tmp_path / "tokenizer.json")


def rank(token):
    return token[0] if len(token) == 1 else 256 + MERGES.index(token)


def ids(*tokens):
    return [rank(token) + SPECIALS for token in tokens]


def test_patterns_split_numbers_as_upstream(vocabulary):
    size = SPECIALS + 256 + len(MERGES)
    v1 = TikTokenizer(vocabulary, "v1", vocab_size=size, num_special_tokens=SPECIALS)
    v2 = TikTokenizer(vocabulary, "v2", vocab_size=size, num_special_tokens=SPECIALS)
    # v1: one digit per piece, so no digit merge applies; v2: pieces of up to three digits ("123", "45").
    assert v1.tokenize("hello world 12345") == ids(b"hello", b" world", b" ", b"1", b"2", b"3", b"4", b"5")
    assert v2.tokenize("hello world 12345") == ids(b"hello", b" world", b" ", b"123", b"4", b"5")


def test_special_tokens_and_round_trip(vocabulary):
    tokenizer = TikTokenizer(vocabulary, "v2", vocab_size=SPECIALS + 256 + len(MERGES), num_special_tokens=SPECIALS)
    assert (tokenizer.unk, tokenizer.bos, tokenizer.eod, tokenizer.pad) == (0, 1, 2, 4)
    assert tokenizer.special_tokens[7:] == ["<SPECIAL_7>", "<SPECIAL_8>", "<SPECIAL_9>"]
    framed = tokenizer.tokenize("hello", bos=True, eos=True)
    assert framed == [1, *ids(b"hello"), 2]
    assert tokenizer.detokenize(framed) == "hello"
    text = "Grüße, 世界! <s> 2024\n\tok"
    assert tokenizer.detokenize(tokenizer.tokenize(text)) == text
    # A special token's spelling in the text is ordinary text.
    assert tokenizer.tokenize("<s>") == ids(b"<", b"s", b">")
    assert tokenizer.vocab_size == SPECIALS + 256 + len(MERGES)


def test_vocabulary_cut_to_vocab_size(vocabulary):
    # Only the first 3 merges fit: "hello" (the 4th) is gone, "hell" + "o" remain.
    tokenizer = TikTokenizer(vocabulary, "v2", vocab_size=SPECIALS + 256 + 3, num_special_tokens=SPECIALS)
    assert tokenizer.tokenize("hello") == ids(b"hell", b"o")


def test_vocabulary_smaller_than_vocab_size_as_upstream(vocabulary):
    """Upstream keeps --vocab-size (default 131072) when the file holds fewer ranks: the ids above them are unused."""
    full = TikTokenizer(vocabulary, "v2", vocab_size=SPECIALS + 256 + len(MERGES), num_special_tokens=SPECIALS)
    larger = TikTokenizer(vocabulary, "v2", vocab_size=400, num_special_tokens=SPECIALS)
    assert larger.vocab_size == 400
    assert larger.tokenize("hello world 12345") == full.tokenize("hello world 12345") == ids(
        b"hello", b" world", b" ", b"123", b"4", b"5")
    default = TikTokenizer(vocabulary, "v2")  # upstream's defaults: 131072 ids, 1000 of them special
    assert (default.vocab_size, default.eod, default.bos) == (2**17, 2, 1)
    assert default.tokenize("hello") == [1000 + rank(b"hello")]
    assert default.detokenize(default.tokenize("hello world")) == "hello world"


def test_flags_build_it(vocabulary, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
            "--train-iters 10 --lr 1e-3 --mock-data --tokenizer-type TikTokenizer")
    args = validate_args(parse_args(args=(f"{base} --tokenizer-model {vocabulary} --tiktoken-pattern v1 "
                                          "--tiktoken-num-special-tokens 10 --vocab-size 270").split()))
    tokenizer = build_tokenizer_from_args(args)
    assert isinstance(tokenizer, TikTokenizer) and tokenizer.vocab_size == 270
    assert tokenizer.tokenize("12") == ids(b"1", b"2")
    with pytest.raises(ValueError, match="needs --tokenizer-model .* and --tiktoken-pattern"):
        validate_args(parse_args(args=f"{base} --tokenizer-model {vocabulary}".split()))
    with pytest.raises(ValueError, match="--tiktoken-num-special-tokens need --tokenizer-type TikTokenizer"):
        validate_args(parse_args(args=(base.replace("TikTokenizer", "NullTokenizer --vocab-size 64")
                                       + " --tiktoken-pattern v2").split()))
    with pytest.raises(ValueError, match="--tiktoken-num-special-tokens need --tokenizer-type TikTokenizer"):
        validate_args(parse_args(args=(base.replace("TikTokenizer", "NullTokenizer --vocab-size 64")
                                       + " --tiktoken-num-special-tokens 10").split()))
    default = validate_args(parse_args(args=f"{base} --tokenizer-model {vocabulary} --tiktoken-pattern v2".split()))
    assert default.tiktoken_num_special_tokens == 1000


def test_file_and_size_checks(tmp_path, vocabulary):
    with pytest.raises(ValueError, match="reads a .json vocabulary"):
        TikTokenizer(str(tmp_path / "tokenizer.model"), "v2", vocab_size=300, num_special_tokens=10)
    with pytest.raises(ValueError, match="at least the 256 byte tokens"):
        TikTokenizer(vocabulary, "v2", vocab_size=200, num_special_tokens=10)
    with pytest.raises(ValueError, match="must include <unk>, <s>, </s>; missing </s>"):
        TikTokenizer(vocabulary, "v2", vocab_size=270, num_special_tokens=10, special_tokens=["<unk>", "<s>"])
    with pytest.raises(ValueError, match="choose v1 or v2"):
        TikTokenizer(vocabulary, "v3", vocab_size=270, num_special_tokens=10)
    entries = json.loads((tmp_path / "tokenizer.json").read_text())
    entries[3]["rank"] = 7
    (tmp_path / "bad.json").write_text(json.dumps(entries))
    with pytest.raises(ValueError, match="entry 3 has rank 7"):
        TikTokenizer(str(tmp_path / "bad.json"), "v2", vocab_size=270, num_special_tokens=10)


def test_upstream_attributes_eos_offsets_and_identifiers(vocabulary):
    size = SPECIALS + 256 + len(MERGES)
    tokenizer = TikTokenizer(vocabulary, "v2", vocab_size=size, num_special_tokens=SPECIALS)
    assert tokenizer.eos == tokenizer.eod == 2
    text = "hello world 12345"
    framed = tokenizer.tokenize(text, bos=True, eos=True)
    assert framed == [1, *ids(b"hello", b" world", b" ", b"123", b"4", b"5"), 2]
    # Where each id starts in the text; the special ids have none and start where the text before ends.
    assert tokenizer.offsets(framed, text) == [0, 0, 5, 11, 12, 15, 16, 17]
    unicode_text = "Grüße 世界"
    unicode_ids = tokenizer.tokenize(unicode_text)
    starts = tokenizer.offsets(unicode_ids, unicode_text)
    assert len(starts) == len(unicode_ids) and starts[0] == 0 and starts == sorted(starts)
    assert starts[-1] == unicode_text.index("界")
    assert tokenizer.unique_identifiers == {
        "class": "TikTokenizer", "tokenizer_path": [vocabulary], "pattern": "v2", "vocab_size": str(size),
        "num_special_tokens": str(SPECIALS), "special_tokens": "None"}

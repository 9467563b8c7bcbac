"""`tools/preprocess_data.py` on input it cannot take: the error names the file, line and what to do, and a dataset
already written at the output prefix is left as it was."""

import gzip
import json
import os

import pytest

from tests.unit_tests.tools.tool_loading import load_tool

NULL_TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "50"]


@pytest.fixture(scope="module")
def preprocess_data():
    return load_tool("preprocess_data", "preprocess_data_bad_input")


@pytest.fixture(autouse=True)
def _tokenizers_parallelism(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # what the worker setup sets, undone after each test


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    """(vocab.json, merges.txt) of a small byte-level BPE."""
    from megatron.training.tokenizer.bpe_training import save_bpe_tokenizer, train_bpe_tokenizer

    directory = tmp_path_factory.mktemp("bpe")
    save_bpe_tokenizer(train_bpe_tokenizer(["the tensor and the pipeline"] * 4, vocab_size=270), str(directory))
    return str(directory / "vocab.json"), str(directory / "merges.txt")


def _exit_message(preprocess_data, arguments):
    with pytest.raises(SystemExit) as exit_info:
        preprocess_data.main(arguments)
    return exit_info.value.code


def test_a_failed_run_leaves_the_dataset_already_at_the_prefix_as_it_was(tmp_path, preprocess_data):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(json.dumps({"text": "1 2 3"}) + "\n")
    bad.write_text(json.dumps({"text": "4"}) + "\n" + json.dumps({"body": "5"}) + "\n")
    output = tmp_path / "out"
    output.mkdir()
    arguments = ["--output-prefix", str(output / "corpus"), *NULL_TOKENIZER, "--log-interval", "0"]
    preprocess_data.main(["--input", str(good), *arguments])
    written = {name: (output / name).read_bytes() for name in sorted(os.listdir(output))}
    assert sorted(written) == ["corpus_text_document.bin", "corpus_text_document.idx"]
    message = _exit_message(preprocess_data, ["--input", str(bad), *arguments])
    assert message.startswith(f"{bad}, line 2: document has no key 'text'")
    assert {name: (output / name).read_bytes() for name in sorted(os.listdir(output))} == written


def test_bytes_that_are_not_utf8_are_named_with_their_file_and_line(tmp_path, preprocess_data):
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "part_0.jsonl").write_text(json.dumps({"text": "1"}) + "\n")
    with gzip.open(shards / "part_1.jsonl.gz", "wb") as compressed:
        compressed.write(b'{"text": "2"}\n{"text": "caf\xe9"}\n')  # Latin-1, not UTF-8
    message = _exit_message(preprocess_data, ["--input", str(shards / "part_*"), "--output-prefix",
                                              str(tmp_path / "o"), *NULL_TOKENIZER])
    assert message == (f"{shards / 'part_1.jsonl.gz'}, line 2: not UTF-8 text (byte 0xe9 at byte 13 of the line); "
                       "the input must be UTF-8 encoded JSON lines; nothing was written")
    assert sorted(os.listdir(tmp_path)) == ["shards"]


@pytest.mark.parametrize("tokenizer_type", ["GPT2BPETokenizer", "ByteLevelTokenizer"])
def test_a_lone_surrogate_is_named_with_its_line(tmp_path, preprocess_data, bpe_files, tokenizer_type):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "the tensor"}\n{"text": "the \\ud800 pipeline"}\n')
    tokenizer_flags = ["--tokenizer-type", tokenizer_type]
    if tokenizer_type == "GPT2BPETokenizer":
        tokenizer_flags += ["--vocab-file", bpe_files[0], "--merge-file", bpe_files[1]]
    message = _exit_message(preprocess_data, ["--input", str(corpus), "--output-prefix", str(tmp_path / "o"),
                                              *tokenizer_flags])
    assert message == (f"{corpus}, line 2: 'text': holds a lone surrogate '\\ud800' at character 4, which is not "
                       "Unicode text; repair or drop the document; nothing was written")
    assert sorted(os.listdir(tmp_path)) == ["corpus.jsonl"]


def test_tokenizer_files_that_do_not_parse_name_the_flags(tmp_path, preprocess_data, bpe_files):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "the tensor"}) + "\n")
    vocab_file, merge_file = bpe_files
    message = _exit_message(preprocess_data, ["--input", str(corpus), "--output-prefix", str(tmp_path / "o"),
                                              "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", merge_file,
                                              "--merge-file", vocab_file])
    assert message == (f"cannot build the --tokenizer-type GPT2BPETokenizer tokenizer from --vocab-file {merge_file} "
                       f"--merge-file {vocab_file}: Error while reading BPE files: expected value at line 1 column 1; "
                       "check that each flag names the right file (--vocab-file vocab.json, --merge-file merges.txt)")
    assert sorted(os.listdir(tmp_path)) == ["corpus.jsonl"]

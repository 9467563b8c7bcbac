"""`tools/preprocess_data.py` with upstream's sentence flags, list-valued keys, `--vocab-extra-ids`,
`--legacy-tokenizer`, empty documents and glob inputs."""

import gzip
import importlib.util
import json
import os
import sys

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset

TOOL = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "tools",
                                    "preprocess_data.py"))
NULL_TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "50"]  # eod is 50


@pytest.fixture(scope="module")
def preprocess_data():
    spec = importlib.util.spec_from_file_location("preprocess_data_upstream_flags", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _tokenizers_parallelism(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # what the worker setup sets, undone after each test


def _corpus(tmp_path, documents):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(document) + "\n" for document in documents))
    return str(path)


class _PeriodSplitter:
    """Stands in for nltk's punkt: a sentence ends at " . "."""

    def __init__(self, lang, keep_newlines):
        self.settings = (lang, keep_newlines)

    def tokenize(self, text):
        return [sentence for sentence in text.split(" . ") if sentence]


def _sequences(dataset):
    return [dataset[i].tolist() for i in range(len(dataset))]


def test_list_values_are_sentences_one_sequence_each(tmp_path, preprocess_data):
    corpus = _corpus(tmp_path, [{"text": ["1 2", "", "3"]}, {"text": "4 5 6"}, {"text": ["7"]}])
    prefix = str(tmp_path / "out")
    preprocess_data.main(["--input", corpus, "--output-prefix", prefix, *NULL_TOKENIZER, "--append-eod",
                          "--log-interval", "0"])
    dataset = IndexedDataset(prefix + "_text_document")
    assert _sequences(dataset) == [[1, 2], [3, 50], [4, 5, 6, 50], [7, 50]]  # the eod ends each document's last
    np.testing.assert_array_equal(dataset.document_indices, [0, 2, 3, 4])
    assert dataset.document(0).tolist() == [1, 2, 3, 50]


def test_a_value_that_is_not_text_names_the_key_and_line(tmp_path, preprocess_data):
    corpus = _corpus(tmp_path, [{"text": "1"}, {"text": 5}])
    with pytest.raises(SystemExit) as exit_info:
        preprocess_data.main(["--input", corpus, "--output-prefix", str(tmp_path / "o"), *NULL_TOKENIZER])
    assert exit_info.value.code == (f"{corpus}, line 2: 'text' must be a string or a list of strings (sentences), "
                                    "got int 5; nothing was written")
    assert sorted(os.listdir(tmp_path)) == ["corpus.jsonl"]


def test_split_sentences_writes_one_sequence_per_sentence(tmp_path, preprocess_data):
    corpus = _corpus(tmp_path, [{"text": "1 2 . 3 . 4"}, {"text": "5 6"}])
    prefix = str(tmp_path / "out")
    args = preprocess_data.parse_args(["--input", corpus, "--output-prefix", prefix, *NULL_TOKENIZER,
                                       "--split-sentences", "--keep-newlines", "--lang", "german", "--append-eod",
                                       "--log-interval", "0"])
    built = []

    def splitter_factory(lang, keep_newlines):
        built.append((lang, keep_newlines))
        return _PeriodSplitter(lang, keep_newlines)

    assert preprocess_data.preprocess(args, splitter_factory) == {"text": prefix + "_text_sentence"}
    assert built[0] == ("german", True)
    dataset = IndexedDataset(prefix + "_text_sentence")
    assert _sequences(dataset) == [[1, 2], [3], [4, 50], [5, 6, 50]]
    np.testing.assert_array_equal(dataset.document_indices, [0, 3, 4])
    assert not os.path.exists(prefix + "_text_document.bin")


def test_split_sentences_without_nltk_says_what_to_install(tmp_path, preprocess_data, monkeypatch):
    monkeypatch.setitem(sys.modules, "nltk", None)  # `import nltk...` raises ImportError, installed or not
    monkeypatch.setitem(sys.modules, "nltk.tokenize", None)
    corpus = _corpus(tmp_path, [{"text": "1 2"}])
    with pytest.raises(SystemExit) as exit_info:
        preprocess_data.main(["--input", corpus, "--output-prefix", str(tmp_path / "o"), *NULL_TOKENIZER,
                              "--split-sentences"])
    message = exit_info.value.code
    assert message.startswith("--split-sentences needs the nltk package, which is not installed: pip install nltk")
    assert sorted(os.listdir(tmp_path)) == ["corpus.jsonl"]


def test_vocab_extra_ids(tmp_path, preprocess_data, capsys):
    corpus = _corpus(tmp_path, [{"text": "1 2"}])
    base = ["--input", corpus, "--output-prefix", str(tmp_path / "o"), *NULL_TOKENIZER]
    assert preprocess_data.parse_args(base + ["--vocab-extra-ids", "0"]).vocab_extra_ids == 0
    with pytest.raises(SystemExit):
        preprocess_data.parse_args(base + ["--vocab-extra-ids", "100"])
    assert "--vocab-extra-ids 100 is not supported" in capsys.readouterr().err


def test_empty_documents_are_kept_so_every_key_stays_aligned_with_the_input(tmp_path, preprocess_data):
    corpus = tmp_path / "corpus.jsonl"
    lines = [{"text": "1 2", "title": ""}, {"text": "", "title": "3"}, {"text": [""], "title": "4"}]
    corpus.write_text("".join(json.dumps(line) + "\n" for line in lines[:2]) + "\n" + json.dumps(lines[2]) + "\n")
    prefix = str(tmp_path / "out")
    preprocess_data.main(["--input", str(corpus), "--output-prefix", prefix, *NULL_TOKENIZER, "--append-eod",
                          "--json-keys", "text", "title", "--log-interval", "0"])
    text, title = IndexedDataset(prefix + "_text_document"), IndexedDataset(prefix + "_title_document")
    # Upstream's layout: an empty text is a document of no sequences; the blank line is no document.
    assert _sequences(text) == [[1, 2, 50]]
    np.testing.assert_array_equal(text.document_indices, [0, 1, 1, 1])
    assert _sequences(title) == [[3, 50], [4, 50]]
    np.testing.assert_array_equal(title.document_indices, [0, 0, 1, 2])
    assert [title.document(i).tolist() for i in range(title.num_documents)] == [[], [3, 50], [4, 50]]


def test_input_glob_of_plain_and_gzip_files_reads_them_in_name_order(tmp_path, preprocess_data):
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "part_1.jsonl").write_text(json.dumps({"text": "3 4"}) + "\n")
    with gzip.open(shards / "part_0.jsonl.gz", "wt") as compressed:
        compressed.write(json.dumps({"text": "1"}) + "\n" + json.dumps({"text": "2"}) + "\n")
    (shards / "part_2.jsonl").write_text(json.dumps({"text": 5}) + "\n")
    prefix = str(tmp_path / "out")
    arguments = ["--output-prefix", prefix, *NULL_TOKENIZER, "--partitions", "2", "--log-interval", "0"]
    preprocess_data.main(["--input", str(shards / "part_[01]*"), *arguments])
    assert _sequences(IndexedDataset(prefix + "_text_document")) == [[1], [2], [3, 4]]
    with pytest.raises(SystemExit) as exit_info:  # a bad line is named by its file and its line in that file
        preprocess_data.main(["--input", str(shards / "part_*"), *arguments])
    assert exit_info.value.code.startswith(f"{shards / 'part_2.jsonl'}, line 1: 'text' must be a string")


def test_legacy_tokenizer_is_accepted_and_changes_nothing(tmp_path, preprocess_data):
    corpus = _corpus(tmp_path, [{"text": "1 2 3"}, {"text": "4 49"}])
    outputs = {}
    for name, extra in (("plain", []), ("legacy", ["--legacy-tokenizer"])):
        args = preprocess_data.parse_args(["--input", corpus, "--output-prefix", str(tmp_path / name),
                                           *NULL_TOKENIZER, "--append-eod", *extra])
        outputs[name] = _sequences(IndexedDataset(preprocess_data.preprocess(args)["text"]))
    assert outputs["legacy"] == outputs["plain"] == [[1, 2, 3, 50], [4, 49, 50]]


def test_several_inputs_are_read_in_the_order_given(tmp_path, preprocess_data, capsys):
    """`--input a b` (also what a shell makes of an unquoted glob): the files one after another, in that order; a
    bad line is named by its own file, and a name that matches nothing is refused before anything is read."""
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "b.jsonl").write_text(json.dumps({"text": "1 2"}) + "\n" + json.dumps({"text": ""}) + "\n")
    (shards / "a.jsonl").write_text(json.dumps({"text": "3"}) + "\n")
    (shards / "c.jsonl").write_text(json.dumps({"text": "4"}) + "\n" + json.dumps({"text": "x"}) + "\n")
    prefix = str(tmp_path / "out")
    arguments = ["--output-prefix", prefix, *NULL_TOKENIZER, "--append-eod", "--log-interval", "0"]
    preprocess_data.main(["--input", str(shards / "b.jsonl"), str(shards / "a.jsonl"), *arguments])
    dataset = IndexedDataset(prefix + "_text_document")
    assert _sequences(dataset) == [[1, 2, 50], [3, 50]]
    np.testing.assert_array_equal(dataset.document_indices, [0, 1, 1, 2])  # b's empty text stays a document
    with pytest.raises(SystemExit) as exit_info:
        preprocess_data.main(["--input", str(shards / "[ab].jsonl"), str(shards / "c.jsonl"), *arguments])
    assert exit_info.value.code == (f"{shards / 'c.jsonl'}, line 2: 'text': invalid literal for int() with base 10: "
                                    "'x' (--tokenizer-type NullTokenizer reads each text as token ids separated by "
                                    "whitespace; tokenize words with a real tokenizer); nothing was written")
    with pytest.raises(SystemExit):
        preprocess_data.parse_args(["--input", str(shards / "a.jsonl"), str(shards / "missing.jsonl"), *arguments])
    assert f"error: --input '{shards / 'missing.jsonl'}' is not a file and matches no file" in capsys.readouterr().err
    assert _sequences(IndexedDataset(prefix + "_text_document")) == [[1, 2, 50], [3, 50]]  # as it was


def test_sentence_flags_without_split_sentences_say_they_change_nothing(tmp_path, preprocess_data, capsys):
    corpus = _corpus(tmp_path, [{"text": "1 2"}])
    base = ["--input", corpus, "--output-prefix", str(tmp_path / "o"), *NULL_TOKENIZER]
    capsys.readouterr()
    preprocess_data.parse_args(base + ["--keep-newlines", "--lang", "german"])
    assert capsys.readouterr().err.splitlines() == [
        f"note: {flag} has no effect without --split-sentences: each text is tokenized whole, newlines included"
        for flag in ("--keep-newlines", "--lang german")]
    preprocess_data.parse_args(base)
    preprocess_data.parse_args(base + ["--keep-newlines", "--split-sentences"])
    assert capsys.readouterr().err == ""

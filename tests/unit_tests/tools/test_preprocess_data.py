import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.training.tokenizer import build_tokenizer
from megatron.training.tokenizer.bpe_training import save_bpe_tokenizer, train_bpe_tokenizer

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))
TOOL = os.path.join(REPO_ROOT, "tools", "preprocess_data.py")


def _documents():
    rng = np.random.default_rng(0)
    words = ["tensor", "parallel", "naïve", "中文", "🙂", "pipeline", "\n", "\t", "the", "data"]
    documents = []
    for number in range(57):
        text = " ".join(words[i] for i in rng.integers(0, len(words), size=int(rng.integers(1, 40))))
        documents.append({"text": text, "title": f"document {number}"})
    documents[5]["text"] = ""  # tokenizes to nothing: a document of no sequences
    return documents


def _write_jsonl(path, documents, blank_line_at=None):
    lines = [json.dumps(document, ensure_ascii=False) + "\n" for document in documents]
    if blank_line_at is not None:
        lines.insert(blank_line_at, "\n")
    with open(path, "w", encoding="utf-8") as output:
        output.writelines(lines)


def _run_tool(*arguments):
    completed = subprocess.run(
        [sys.executable, TOOL, *arguments], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stderr


@pytest.fixture(scope="module")
def preprocess_data():
    """The tool as a module: runs with one worker call its `main(argv)` in this process (runs with a pool of
    workers start the script as a command)."""
    spec = importlib.util.spec_from_file_location("preprocess_data", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_main(preprocess_data, monkeypatch, capsys, *arguments):
    """`main(arguments)` in this process; what it printed to stderr."""
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # what the worker setup sets, undone after the test
    capsys.readouterr()
    preprocess_data.main(list(arguments))
    return capsys.readouterr().err


@pytest.fixture(scope="module")
def trained_bpe(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bpe")
    backend = train_bpe_tokenizer([document["text"] for document in _documents()] * 3, vocab_size=290)
    return save_bpe_tokenizer(backend, str(directory))


@pytest.mark.parametrize("tokenizer_type", ["ByteLevelTokenizer", "HuggingFaceTokenizer"])
def test_workers_give_identical_output_equal_to_direct_tokenization(tmp_path, tokenizer_type, trained_bpe,
                                                                   preprocess_data, monkeypatch, capsys):
    documents = _documents()
    corpus = str(tmp_path / "corpus.jsonl")
    _write_jsonl(corpus, documents, blank_line_at=20)
    tokenizer_flags = ["--tokenizer-type", tokenizer_type]
    if tokenizer_type == "HuggingFaceTokenizer":
        tokenizer_flags += ["--tokenizer-model", trained_bpe]
    outputs = {}
    for workers in (1, 2):
        prefix = str(tmp_path / f"workers{workers}" / "out")
        arguments = ("--input", corpus, "--output-prefix", prefix, *tokenizer_flags, "--append-eod",
                     "--json-keys", "text", "--workers", str(workers), "--log-interval", "10")
        if workers == 1:
            log = _run_main(preprocess_data, monkeypatch, capsys, *arguments)
        else:
            log = _run_tool(*arguments)
        progress = [line for line in log.splitlines() if line.startswith("processed")]
        assert progress[0].startswith("processed 10 documents") and "docs/s" in progress[0] and "MB/s" in progress[0]
        assert progress[-1].startswith("processed 58 documents")  # 57 documents and a blank line
        outputs[workers] = prefix + "_text_document"
    for suffix in (".bin", ".idx"):
        with open(outputs[1] + suffix, "rb") as one, open(outputs[2] + suffix, "rb") as two:
            assert one.read() == two.read()
    tokenizer = build_tokenizer(tokenizer_type, tokenizer_model=trained_bpe)
    expected = [tokenizer.tokenize(document["text"]) + [tokenizer.eod] for document in documents if document["text"]]
    dataset = IndexedDataset(outputs[1])
    assert dataset.dtype == np.uint16
    assert (len(dataset), dataset.num_documents) == (len(expected), 57) == (56, 57)  # the empty text is kept
    assert int(dataset.sequence_lengths.sum()) == sum(map(len, expected))
    for index, tokens in enumerate(expected):
        np.testing.assert_array_equal(dataset[index], tokens)
    assert tokenizer.detokenize(dataset[0][:-1].tolist()) == documents[0]["text"]


def test_the_tool_starts_without_loading_torch():
    """A run of the tool is a fresh interpreter: its imports (the indexed-dataset writer, the tokenizers and their
    flags) leave out torch and the training flags' groups, seconds of CPU that tokenizing does not need."""
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('preprocess_data', {TOOL!r})\n"
            "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
            "print(sorted(name for name in ('torch', 'megatron.training.argument_groups') if name in sys.modules))\n")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "[]"


def test_null_tokenizer_and_several_keys(tmp_path):
    documents = [{"text": " ".join(str(i) for i in range(n, n + 5)), "extra": str(n)} for n in range(12)]
    corpus = str(tmp_path / "ids.jsonl")
    _write_jsonl(corpus, documents)
    prefix = str(tmp_path / "ids")
    _run_tool("--input", corpus, "--output-prefix", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
              "--json-keys", "text", "extra", "--workers", "2")
    text = IndexedDataset(prefix + "_text_document")
    extra = IndexedDataset(prefix + "_extra_document")
    assert len(text) == len(extra) == 12
    np.testing.assert_array_equal(text[3], [3, 4, 5, 6, 7])  # no --append-eod: no eod
    np.testing.assert_array_equal(extra[11], [11])


def test_upstream_partitions_flags_are_accepted(tmp_path, preprocess_data, monkeypatch, capsys):
    documents = [{"text": " ".join(str(i) for i in range(n, n + 3))} for n in range(6)]
    corpus = str(tmp_path / "ids.jsonl")
    _write_jsonl(corpus, documents)
    prefix = str(tmp_path / "ids")
    _run_main(preprocess_data, monkeypatch, capsys, "--input", corpus, "--output-prefix", prefix, "--tokenizer-type",
              "NullTokenizer", "--vocab-size", "64", "--partitions", "3", "--keep-sequential-samples", "--workers", "1")
    written = IndexedDataset(prefix + "_text_document")
    assert [written[i].tolist() for i in range(len(written))] == [[n, n + 1, n + 2] for n in range(6)]


@pytest.mark.parametrize("workers", [1, 2])
def test_missing_key_is_reported_and_nothing_is_left_behind(tmp_path, workers, preprocess_data, monkeypatch):
    corpus = str(tmp_path / "corpus.jsonl")
    _write_jsonl(corpus, [{"text": "a", "title": "t"}, {"text": "b"}])
    arguments = ["--input", corpus, "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "ByteLevelTokenizer",
                 "--json-keys", "text", "title", "--workers", str(workers)]
    if workers == 1:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # what the worker setup sets, undone after the test
        with pytest.raises(SystemExit) as exit_info:
            preprocess_data.main(arguments)
        # A SystemExit carrying a message: Python prints the message alone (no traceback) and exits with status 1.
        message = exit_info.value.code
        assert isinstance(message, str)
    else:
        completed = subprocess.run([sys.executable, TOOL, *arguments], capture_output=True, text=True,
                                   cwd=REPO_ROOT, timeout=120)
        assert completed.returncode != 0
        message = completed.stderr
    assert f"{corpus}, line 2: document has no key 'title'" in message and "--json-keys" in message
    assert "nothing was written" in message and "Traceback" not in message
    assert sorted(os.listdir(tmp_path)) == ["corpus.jsonl"]  # no .bin without its .idx


def test_tiktokenizer_flags_and_tokenizer_errors_name_the_flag(tmp_path, preprocess_data, monkeypatch, capsys):
    """`--tokenizer-type TikTokenizer` with its own flags; over a vocabulary of the 256 bytes alone, a text's ids
    are its UTF-8 bytes plus the number of special tokens, and `</s>` (the third special token) ends it."""
    pytest.importorskip("tiktoken")
    import base64

    vocabulary = tmp_path / "bytes.json"
    vocabulary.write_text(json.dumps([{"rank": value, "token_bytes": base64.b64encode(bytes([value])).decode(),
                                       "token_str": chr(value)} for value in range(256)]))
    documents = _documents()[:8]
    corpus = str(tmp_path / "corpus.jsonl")
    _write_jsonl(corpus, documents)
    prefix = str(tmp_path / "tik")
    tokenizer_flags = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(vocabulary)]
    _run_main(preprocess_data, monkeypatch, capsys, "--input", corpus, "--output-prefix", prefix, *tokenizer_flags,
              "--tiktoken-pattern", "v2", "--tiktoken-num-special-tokens", "10", "--vocab-size", "266",
              "--append-eod")
    dataset = IndexedDataset(prefix + "_text_document")
    expected = [[byte + 10 for byte in document["text"].encode("utf-8")] + [2] for document in documents
                if document["text"]]
    assert len(dataset) == len(expected) == 7
    for index, tokens in enumerate(expected):
        np.testing.assert_array_equal(dataset[index], tokens)
    with pytest.raises(SystemExit) as exit_info:
        _run_main(preprocess_data, monkeypatch, capsys, "--input", corpus, "--output-prefix", str(tmp_path / "no"),
                  *tokenizer_flags)
    assert exit_info.value.code == ("cannot build the --tokenizer-type TikTokenizer tokenizer: --tokenizer-type "
                                    "TikTokenizer needs --tokenizer-model and --tiktoken-pattern")
    assert not any(name.startswith("no_") for name in os.listdir(tmp_path))


def _llama3_like_directory(directory):
    """A Hugging Face tokenizer directory that starts every text with <|begin_of_text|> and ends documents with
    its eos_token <|eot_id|> (not <|endoftext|>, which is in the vocabulary too)."""
    import tokenizers
    import transformers

    backend = train_bpe_tokenizer([document["text"] for document in _documents()] * 3, vocab_size=290,
                                  special_tokens=["<|endoftext|>", "<|begin_of_text|>", "<|eot_id|>"])
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", backend.token_to_id("<|begin_of_text|>"))])
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>",
                                         eos_token="<|eot_id|>").save_pretrained(str(directory))
    return transformers.AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.parametrize("tokenizer_type", ["GPT2BPETokenizer", "HuggingFaceTokenizer"])
def test_upstream_tokenizer_files_give_the_reference_ids_with_any_workers(tmp_path, tokenizer_type, trained_bpe,
                                                                          preprocess_data, monkeypatch, capsys):
    """GPT2BPETokenizer from vocab.json + merges.txt writes transformers.GPT2Tokenizer's ids and <|endoftext|>;
    HuggingFaceTokenizer from a tokenizer directory writes AutoTokenizer(text).input_ids (its beginning-of-sequence
    token included, as upstream) and eos_token_id; the same bytes with 1 and 2 workers."""
    transformers = pytest.importorskip("transformers")
    if tokenizer_type == "GPT2BPETokenizer":
        directory = os.path.dirname(trained_bpe)
        vocab_file, merge_file = os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
        tokenizer_flags = ["--vocab-file", vocab_file, "--merge-file", merge_file]
        reference = transformers.GPT2Tokenizer(vocab_file, merge_file)
        expected_ids, eod = reference.encode, reference.convert_tokens_to_ids("<|endoftext|>")
    else:
        reference = _llama3_like_directory(tmp_path / "hf")
        tokenizer_flags = ["--tokenizer-model", str(tmp_path / "hf")]
        expected_ids, eod = (lambda text: reference(text).input_ids), reference.eos_token_id
        assert eod != reference.convert_tokens_to_ids("<|endoftext|>")
    documents = _documents()[:12]
    corpus = str(tmp_path / "corpus.jsonl")
    _write_jsonl(corpus, documents)
    # The pool's workers fork from this process, and find the tool's functions under its module name.
    monkeypatch.setitem(sys.modules, preprocess_data.__name__, preprocess_data)
    outputs = {}
    for workers in (1, 2):
        arguments = ("--input", corpus, "--output-prefix", str(tmp_path / f"w{workers}"), "--tokenizer-type",
                     tokenizer_type, *tokenizer_flags, "--append-eod", "--workers", str(workers))
        _run_main(preprocess_data, monkeypatch, capsys, *arguments)
        outputs[workers] = str(tmp_path / f"w{workers}_text_document")
    for suffix in (".bin", ".idx"):
        with open(outputs[1] + suffix, "rb") as one, open(outputs[2] + suffix, "rb") as two:
            assert one.read() == two.read()
    # As upstream, a text whose ids are only the tokenizer's own (the empty text's <|begin_of_text|>) is a sequence.
    expected = [expected_ids(document["text"]) + [eod] for document in documents if expected_ids(document["text"])]
    dataset = IndexedDataset(outputs[1])
    assert len(dataset) == len(expected) == (11 if tokenizer_type == "GPT2BPETokenizer" else 12)
    for index, tokens in enumerate(expected):
        np.testing.assert_array_equal(dataset[index], tokens)


def test_sentencepiece_tokenizer_types_name_the_package(tmp_path, preprocess_data, monkeypatch):
    corpus = str(tmp_path / "corpus.jsonl")
    _write_jsonl(corpus, _documents()[:1])
    model = tmp_path / "tokenizer.model"
    model.write_bytes(b"\x0a\x01x")
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    with pytest.raises(SystemExit) as exit_info:
        preprocess_data.main(["--input", corpus, "--output-prefix", str(tmp_path / "o"), "--tokenizer-type",
                              "GPTSentencePieceTokenizer", "--tokenizer-model", str(model)])
    assert str(exit_info.value.code).endswith("--tokenizer-type GPTSentencePieceTokenizer reads its --tokenizer-model "
                                              ".model file with the `sentencepiece` package, which is not installed: "
                                              "pip install sentencepiece")
    assert not any(name.startswith("o_") for name in os.listdir(tmp_path))


def test_llama2_tokenizer_documents_start_with_bos(tmp_path, preprocess_data, monkeypatch, capsys):
    sentencepiece = pytest.importorskip("sentencepiece")
    documents = _documents()[:6]
    corpus, model = str(tmp_path / "corpus.jsonl"), str(tmp_path / "tokenizer.model")
    _write_jsonl(corpus, documents)
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter([d["text"] for d in documents]),
                                             model_prefix=str(tmp_path / "tokenizer"), vocab_size=60,
                                             hard_vocab_limit=False, minloglevel=2)
    _run_main(preprocess_data, monkeypatch, capsys, "--input", corpus, "--output-prefix", str(tmp_path / "o"),
              "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", model, "--append-eod")
    pieces = sentencepiece.SentencePieceProcessor(model_file=model)
    dataset = IndexedDataset(str(tmp_path / "o_text_document"))
    expected = [[1] + pieces.encode(document["text"]) + [2] for document in documents]  # bos ... eos (the eod)
    assert len(dataset) == len(expected)
    for index, tokens in enumerate(expected):
        np.testing.assert_array_equal(dataset[index], tokens)

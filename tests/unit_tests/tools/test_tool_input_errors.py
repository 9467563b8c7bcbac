"""Command-line tools refuse input that would give an empty or wrong result, naming the flag, and write nothing."""


import pytest
from tests.unit_tests.tools.tool_loading import load_tool



def _load_tool(name):
    return load_tool(name, f"tools_{name}_errors")


@pytest.fixture(scope="module")
def build_corpus():
    return _load_tool("build_corpus")


@pytest.fixture
def tiny_stdlib(tmp_path):
    """A standard-library root with one documented module (`alpha`, 300 characters of docstring)."""
    root = tmp_path / "stdlib"
    root.mkdir()
    (root / "alpha.py").write_text('"""' + "Alpha documentation. " * 15 + '"""\n')
    return root


def test_build_corpus_writes_the_documented_module(build_corpus, tiny_stdlib, tmp_path):
    output = tmp_path / "out" / "corpus.jsonl"
    count, size = build_corpus.main(["--output", str(output), "--stdlib-dir", str(tiny_stdlib), "--modules", "alpha",
                                     "--no-licence-copy"])
    assert count == 1 and size == output.stat().st_size > 300


@pytest.mark.parametrize("arguments, named", [
    (["--modules", "no_such_module"], "--modules no_such_module"),
    (["--modules", "alpha", "--max-bytes", "100"], "--max-bytes 100"),
    (["--stdlib-dir", "MISSING"], "--stdlib-dir"),
    (["--stdlib-dir", "EMPTY"], "--stdlib-dir"),
])
def test_build_corpus_refuses_an_empty_corpus(build_corpus, tiny_stdlib, tmp_path, arguments, named):
    (tmp_path / "empty").mkdir()
    replacements = {"MISSING": str(tmp_path / "missing"), "EMPTY": str(tmp_path / "empty")}
    arguments = [replacements.get(argument, argument) for argument in arguments]
    if "--stdlib-dir" not in arguments:
        arguments += ["--stdlib-dir", str(tiny_stdlib)]
    output = tmp_path / "out" / "corpus.jsonl"
    with pytest.raises(SystemExit) as raised:
        build_corpus.main(["--output", str(output), "--no-licence-copy", *arguments])
    assert named in str(raised.value.code)
    assert not output.parent.exists()


def test_text_generation_cli_help_prints_usage_without_prompting():
    cli = _load_tool("text_generation_cli")
    printed = []

    def read(question):
        raise AssertionError(f"asked {question!r} instead of printing the usage")

    assert cli.main(["--help"], read=read, write=printed.append) == 0
    assert printed[0].startswith("usage: python tools/text_generation_cli.py HOST:PORT")
    printed.clear()
    assert cli.main(["--port"], read=read, write=printed.append) == 2
    assert "HOST:PORT" in printed[0]


@pytest.fixture(scope="module")
def train_tokenizer():
    pytest.importorskip("tokenizers")
    return _load_tool("train_tokenizer")


def test_train_tokenizer_names_a_missing_json_key(train_tokenizer, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "hello world"}\n\n{"content": "no text here"}\n')
    output = tmp_path / "tok"
    with pytest.raises(SystemExit) as raised:
        train_tokenizer.main(["--input", str(corpus), "--vocab-size", "300", "--output-dir", str(output)])
    message = str(raised.value.code)
    assert "--json-keys text" in message and "line 3" in message and "content" in message
    assert not output.exists()


def test_train_tokenizer_names_a_too_small_vocab_size(train_tokenizer, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "hello world"}\n')
    with pytest.raises(SystemExit) as raised:
        train_tokenizer.main(["--input", str(corpus), "--vocab-size", "100", "--output-dir", str(tmp_path / "tok")])
    assert "--vocab-size" in str(raised.value.code) and "258" in str(raised.value.code)
    assert not (tmp_path / "tok").exists()

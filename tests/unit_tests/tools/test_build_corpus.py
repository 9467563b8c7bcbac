import inspect
import json
import os
import sysconfig

import pytest
from tests.unit_tests.tools.tool_loading import load_tool

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))
CORPUS_DIR = os.path.join(REPO_ROOT, "data", "corpus")


def _load_tool(name):
    return load_tool(name)


@pytest.fixture(scope="module")
def build_corpus():
    return _load_tool("build_corpus")


def test_module_documents_hold_the_docstrings(build_corpus):
    import json as json_module

    documents = build_corpus.build_documents(sysconfig.get_paths()["stdlib"], ["json"])
    sources = [document["source"] for document in documents]
    assert sources == sorted(sources) and "module:json" in sources and "module:json.decoder" in sources
    assert all(source == "module:json" or source.startswith("module:json.") for source in sources)
    package_text = documents[sources.index("module:json")]["text"]
    assert package_text.startswith("Module json\n\n" + inspect.cleandoc(json_module.__doc__))
    assert "def json.dumps(obj, *, skipkeys=False" in package_text
    assert inspect.cleandoc(json_module.dumps.__doc__) in package_text
    decoder_text = documents[sources.index("module:json.decoder")]["text"]
    assert "class json.decoder.JSONDecoder" in decoder_text
    assert inspect.cleandoc(json_module.JSONDecoder.decode.__doc__) in decoder_text


def test_output_is_deterministic_and_capped(build_corpus, tmp_path):
    arguments = ["--modules", "json", "csv", "--no-licence-copy"]
    first = build_corpus.main(["--output", str(tmp_path / "a.jsonl"), *arguments])
    second = build_corpus.main(["--output", str(tmp_path / "b.jsonl"), *arguments])
    assert first == second
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    count, size = build_corpus.main(["--output", str(tmp_path / "c.jsonl"), "--max-bytes", "20000", *arguments])
    assert 0 < count < first[0] and size <= 20000
    assert (tmp_path / "c.jsonl").read_bytes() == (tmp_path / "a.jsonl").read_bytes()[:size]


def test_bundled_corpus():
    path = os.path.join(CORPUS_DIR, "stdlib_docs.jsonl")
    size = os.path.getsize(path)
    assert 1_000_000 <= size <= 3_000_000
    with open(path, encoding="utf-8") as corpus:
        documents = [json.loads(line) for line in corpus]
    assert len(documents) > 400
    assert all(isinstance(document["text"], str) and len(document["text"]) >= 200 for document in documents)
    assert len({document["source"] for document in documents}) == len(documents)
    for name in ("LICENSE", "README.md", "PYTHON_LICENSE.txt"):
        assert os.path.isfile(os.path.join(CORPUS_DIR, name))
    assert "Python Software Foundation" in open(os.path.join(CORPUS_DIR, "PYTHON_LICENSE.txt")).read()

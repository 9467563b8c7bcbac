import json
import os

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tests.unit_tests.tools.tool_loading import load_tool



def _load_tool(name):
    return load_tool(name, name)


@pytest.fixture(scope="module")
def merge_tool():
    return _load_tool("merge_datasets")


@pytest.fixture(scope="module")
def preprocess_tool():
    return _load_tool("preprocess_data")


def _write_jsonl(path, texts):
    with open(path, "w", encoding="utf-8") as output:
        output.writelines(json.dumps({"text": text}) + "\n" for text in texts)


def _preprocess(preprocess_tool, corpus, prefix):
    preprocess_tool.main(["--input", corpus, "--output-prefix", prefix, "--tokenizer-type", "NullTokenizer",
                          "--vocab-size", "100", "--append-eod", "--log-interval", "0"])
    return prefix + "_text_document"


def _build(prefix, documents, dtype=np.uint16):
    """A dataset of documents given as lists of sequences."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for sequences in documents:
        builder.add_document([token for sequence in sequences for token in sequence], [len(s) for s in sequences])
    builder.finalize(prefix + ".idx")


def test_merging_shards_equals_preprocessing_their_concatenation(tmp_path, merge_tool, preprocess_tool):
    rng = np.random.default_rng(3)
    texts = [" ".join(str(token) for token in rng.integers(0, 100, size=int(rng.integers(1, 12)))) for _ in range(45)]
    texts[7] = ""  # an empty document is a document of no sequences, in the shards as in the whole
    first, second = texts[:30], texts[30:]
    for name, part in (("a", first), ("b", second), ("ab", texts)):
        _write_jsonl(tmp_path / f"{name}.jsonl", part)
    shards = tmp_path / "shards"
    _preprocess(preprocess_tool, str(tmp_path / "a.jsonl"), str(shards / "part_0"))
    _preprocess(preprocess_tool, str(tmp_path / "b.jsonl"), str(shards / "part_1"))
    whole = _preprocess(preprocess_tool, str(tmp_path / "ab.jsonl"), str(tmp_path / "whole" / "ab"))
    merged = str(tmp_path / "merged" / "ab_text_document")
    merge_tool.main(["--input", str(shards), "--output-prefix", merged])
    for suffix in (".bin", ".idx"):
        assert (tmp_path / "merged" / f"ab_text_document{suffix}").read_bytes() == open(whole + suffix, "rb").read()
    dataset = IndexedDataset(merged)
    assert (dataset.num_documents, len(dataset)) == (45, 44)
    first_shard = IndexedDataset(str(shards / "part_0_text_document"))
    assert (first_shard.num_documents, len(first_shard)) == (30, 29)
    assert dataset.document(7).size == 0
    np.testing.assert_array_equal(dataset.document(29), [int(t) for t in texts[29].split()] + [100])
    np.testing.assert_array_equal(dataset.document(30), [int(t) for t in texts[30].split()] + [100])


def test_document_boundaries_of_multi_sequence_documents_survive_the_merge(tmp_path, merge_tool):
    shard_documents = {
        "s0": [[[1, 2], [3]], [[4]]],
        "s1": [[[5], [6, 7], [8]]],
        "s2": [[[9, 9, 9]], [[10], [11]], [[12]]],
    }
    for name, documents in shard_documents.items():
        _build(str(tmp_path / name), documents)
    merged = merge_tool.merge_datasets(merge_tool.find_dataset_prefixes(str(tmp_path)), str(tmp_path / "out" / "m"))
    dataset = IndexedDataset(merged)
    # Documents of 2, 1, 3, 1, 2, 1 sequences.
    np.testing.assert_array_equal(dataset.document_indices, [0, 2, 3, 6, 7, 9, 10])
    np.testing.assert_array_equal(dataset.sequence_lengths, [2, 1, 1, 1, 2, 1, 3, 1, 1, 1])
    all_documents = [document for documents in shard_documents.values() for document in documents]
    for index, sequences in enumerate(all_documents):
        np.testing.assert_array_equal(dataset.document(index), [t for sequence in sequences for t in sequence])


def test_shards_are_merged_in_sorted_order_and_other_files_are_left_out(tmp_path, merge_tool):
    _build(str(tmp_path / "b"), [[[2]]])
    _build(str(tmp_path / "a"), [[[1]]])
    (tmp_path / "README.md").write_text("notes")
    assert merge_tool.find_dataset_prefixes(str(tmp_path)) == [str(tmp_path / "a"), str(tmp_path / "b")]


def test_errors_name_the_problem_and_write_nothing(tmp_path, merge_tool, capsys):
    inputs, output = tmp_path / "in", tmp_path / "out" / "m"
    inputs.mkdir()
    _build(str(inputs / "a"), [[[1]]])
    _build(str(inputs / "b"), [[[70000]]], dtype=np.int32)
    with pytest.raises(SystemExit) as exit_info:
        merge_tool.main(["--input", str(inputs), "--output-prefix", str(output)])
    assert f"cannot merge {inputs / 'b'} (int32 tokens) with {inputs / 'a'} (uint16 tokens)" in exit_info.value.code
    assert not (tmp_path / "out").exists()

    os.remove(inputs / "b.idx")
    with pytest.raises(SystemExit) as exit_info:
        merge_tool.main(["--input", str(inputs), "--output-prefix", str(output)])
    assert f"{inputs / 'b.bin'} has no matching .bin/.idx file" in exit_info.value.code

    os.remove(inputs / "b.bin")
    with pytest.raises(SystemExit) as exit_info:
        merge_tool.main(["--input", str(inputs), "--output-prefix", str(inputs / "a")])
    assert "is one of the inputs" in exit_info.value.code
    assert IndexedDataset(str(inputs / "a"))[0].tolist() == [1]  # the input is untouched

    with pytest.raises(SystemExit):
        merge_tool.main(["--input", str(inputs), "--output-prefix", str(output), "--multimodal"])
    assert "--multimodal is not supported" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        merge_tool.main(["--input", str(tmp_path / "missing"), "--output-prefix", str(output)])
    assert "is not a directory" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_merge_that_fails_part_way_leaves_the_earlier_output_as_it_was(tmp_path, merge_tool, monkeypatch):
    inputs, output = tmp_path / "in", tmp_path / "out" / "merged"
    inputs.mkdir()
    _build(str(inputs / "a"), [[[1]]])
    _build(str(inputs / "b"), [[[2, 3]]])
    merge_tool.main(["--input", str(inputs), "--output-prefix", str(output)])
    written = {name: (output.parent / name).read_bytes() for name in sorted(os.listdir(output.parent))}
    assert sorted(written) == ["merged.bin", "merged.idx"]
    _build(str(inputs / "c"), [[[4]]])
    add_index = IndexedDatasetBuilder.add_index

    def fail_on_the_last_input(builder, prefix):
        if prefix.endswith("c"):
            raise OSError(28, "No space left on device")
        add_index(builder, prefix)

    monkeypatch.setattr(IndexedDatasetBuilder, "add_index", fail_on_the_last_input)
    with pytest.raises(OSError, match="No space left on device"):
        merge_tool.main(["--input", str(inputs), "--output-prefix", str(output)])
    assert {name: (output.parent / name).read_bytes() for name in sorted(os.listdir(output.parent))} == written
    assert IndexedDataset(str(output)).document(1).tolist() == [2, 3]

import os
import pickle
import struct

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import (
    HEADER_SIZE,
    INDEX_MAGIC,
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexFileError,
    optimal_token_dtype,
)


def _random_documents(seed, num_documents, max_sequences, max_length, high):
    """[[sequence arrays] per document] with some empty sequences."""
    rng = np.random.default_rng(seed)
    return [
        [rng.integers(0, high, size=rng.integers(0, max_length)) for _ in range(rng.integers(1, max_sequences + 1))]
        for _ in range(num_documents)
    ]


def _write(prefix, documents, dtype):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for document in documents:
        for sequence in document:
            builder.add_item(sequence)
        builder.end_document()
    builder.finalize(prefix + ".idx")


def _check_matches(dataset, documents, dtype):
    sequences = [sequence for document in documents for sequence in document]
    assert len(dataset) == len(sequences)
    assert dataset.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(dataset.sequence_lengths, [len(s) for s in sequences])
    expected_document_indices = np.cumsum([0] + [len(document) for document in documents])
    np.testing.assert_array_equal(dataset.document_indices, expected_document_indices)
    assert dataset.num_documents == len(documents)
    for index, sequence in enumerate(sequences):
        np.testing.assert_array_equal(dataset[index], sequence.astype(dtype))
        assert dataset[index].dtype == np.dtype(dtype)
    for document_index, document in enumerate(documents):
        np.testing.assert_array_equal(dataset.document(document_index), np.concatenate(document).astype(dtype))


@pytest.mark.parametrize(
    "dtype,high", [(np.uint8, 256), (np.uint16, 65535), (np.int32, 2**31 - 1), (np.int64, 2**40), (np.float32, 1000)]
)
def test_round_trip(tmp_path, dtype, high):
    documents = _random_documents(seed=int(high) % 97, num_documents=25, max_sequences=3, max_length=40, high=high)
    prefix = str(tmp_path / "data")
    _write(prefix, documents, dtype)
    dataset = IndexedDataset(prefix)
    _check_matches(dataset, documents, dtype)
    # Header fields are at the documented places.
    with open(prefix + ".idx", "rb") as index_file:
        header = index_file.read(HEADER_SIZE)
    assert header[:9] == INDEX_MAGIC
    version, code, sequences, document_count = struct.unpack("<QBQQ", header[9:])
    assert (version, sequences, document_count) == (1, len(dataset), len(documents) + 1)
    assert os.path.getsize(prefix + ".bin") == sum(map(len, dataset[:])) * np.dtype(dtype).itemsize


def test_get_reads_partial_sequences_and_slices(tmp_path):
    prefix = str(tmp_path / "data")
    tokens = np.arange(100, 130)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    builder.add_document(tokens, [10, 20])
    builder.finalize(prefix + ".idx")
    dataset = IndexedDataset(prefix)
    np.testing.assert_array_equal(dataset.get(1, offset=5, length=7), np.arange(115, 122))
    np.testing.assert_array_equal(dataset.get(1, offset=18), [128, 129])
    np.testing.assert_array_equal(dataset.get(0), np.arange(100, 110))
    np.testing.assert_array_equal(dataset[-1], np.arange(110, 130))
    assert [len(sequence) for sequence in dataset[0:2]] == [10, 20]
    with pytest.raises(IndexError):
        dataset.get(0, offset=5, length=6)
    with pytest.raises(IndexError):
        dataset[2]


def test_pickling_reopens_by_path(tmp_path):
    prefix = str(tmp_path / "data")
    documents = _random_documents(seed=5, num_documents=4, max_sequences=2, max_length=10, high=100)
    _write(prefix, documents, np.int32)
    payload = pickle.dumps(IndexedDataset(prefix))
    assert len(payload) < 200  # the path, not the tokens
    _check_matches(pickle.loads(payload), documents, np.int32)


def test_merge_appends_datasets_in_order(tmp_path):
    parts = [_random_documents(seed, 7, 2, 20, 50000) for seed in (1, 2, 3)]
    prefixes = []
    for number, documents in enumerate(parts):
        prefixes.append(str(tmp_path / f"part{number}"))
        _write(prefixes[-1], documents, np.uint16)
    merged = str(tmp_path / "merged")
    builder = IndexedDatasetBuilder(merged + ".bin", dtype=np.uint16)
    for prefix in prefixes:
        builder.add_index(prefix)
    builder.finalize(merged + ".idx")
    _check_matches(IndexedDataset(merged), [document for part in parts for document in part], np.uint16)


def test_merge_rejects_other_dtype(tmp_path):
    prefix = str(tmp_path / "part")
    _write(prefix, [[np.arange(5)]], np.int32)
    builder = IndexedDatasetBuilder(str(tmp_path / "merged.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match="dtype is int32"):
        builder.add_index(prefix)


def test_empty_dataset(tmp_path):
    prefix = str(tmp_path / "empty")
    IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16).finalize(prefix + ".idx")
    dataset = IndexedDataset(prefix)
    assert len(dataset) == 0 and dataset.num_documents == 0


def test_optimal_token_dtype():
    assert optimal_token_dtype(257) == np.uint16
    assert optimal_token_dtype(65499) == np.uint16
    assert optimal_token_dtype(128256) == np.int32


@pytest.fixture
def small_dataset(tmp_path):
    prefix = str(tmp_path / "data")
    _write(prefix, [[np.arange(10)], [np.arange(7), np.arange(3)]], np.int32)
    return prefix


def _rewrite(path, edit):
    data = bytearray(open(path, "rb").read())
    edit(data)
    open(path, "wb").write(bytes(data))


def test_bad_magic_names_file_and_problem(small_dataset):
    _rewrite(small_dataset + ".idx", lambda data: data.__setitem__(slice(0, 4), b"XXXX"))
    with pytest.raises(IndexFileError, match=r"data\.idx.*bad magic"):
        IndexedDataset(small_dataset)


def test_wrong_version(small_dataset):
    _rewrite(small_dataset + ".idx", lambda data: data.__setitem__(slice(9, 17), struct.pack("<Q", 7)))
    with pytest.raises(IndexFileError, match=r"data\.idx.*unsupported version 7"):
        IndexedDataset(small_dataset)


def test_unknown_dtype_code(small_dataset):
    _rewrite(small_dataset + ".idx", lambda data: data.__setitem__(17, 99))
    with pytest.raises(IndexFileError, match="unknown dtype code 99"):
        IndexedDataset(small_dataset)


def test_truncated_index(small_dataset):
    _rewrite(small_dataset + ".idx", lambda data: data.__delitem__(slice(-12, None)))
    with pytest.raises(IndexFileError, match=r"data\.idx.*truncated or corrupt"):
        IndexedDataset(small_dataset)


def test_truncated_header(small_dataset):
    _rewrite(small_dataset + ".idx", lambda data: data.__delitem__(slice(12, None)))
    with pytest.raises(IndexFileError, match="shorter than the 34-byte header"):
        IndexedDataset(small_dataset)


def test_data_file_size_mismatch(small_dataset):
    _rewrite(small_dataset + ".bin", lambda data: data.__delitem__(slice(-4, None)))
    with pytest.raises(IndexFileError, match=r"data\.idx.*80 bytes.*data file has 76 bytes"):
        IndexedDataset(small_dataset)


def test_inconsistent_pointers(small_dataset):
    pointer_offset = HEADER_SIZE + 3 * 4 + 8  # second sequence pointer
    pointer_bytes = slice(pointer_offset, pointer_offset + 8)
    _rewrite(small_dataset + ".idx", lambda data: data.__setitem__(pointer_bytes, struct.pack("<q", 4)))
    with pytest.raises(IndexFileError, match="pointers do not match"):
        IndexedDataset(small_dataset)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothing\.idx.*nothing\.bin"):
        IndexedDataset(str(tmp_path / "nothing"))


def test_upstream_constructor_and_helpers(small_dataset, tmp_path):
    from megatron.core.datasets.indexed_dataset import get_bin_path, get_idx_path

    # Upstream's signature: IndexedDataset(path_prefix, multimodal=False, mmap=True), and its path helpers.
    dataset = IndexedDataset(small_dataset, False, False)
    assert not dataset.mmap and dataset[2].tolist() == [0, 1, 2]
    assert IndexedDataset(small_dataset, multimodal=False, mmap=True).mmap
    assert (get_bin_path("a/b"), get_idx_path("a/b")) == ("a/b.bin", "a/b.idx")
    assert IndexedDataset.exists(small_dataset)
    os.remove(small_dataset + ".bin")
    assert not IndexedDataset.exists(small_dataset) and not IndexedDataset.exists(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="multimodal datasets .* are not supported"):
        IndexedDataset(small_dataset + "x", multimodal=True)



def test_upstream_builder_calls_with_modes_and_document_index_accessors(tmp_path):
    import torch

    # Upstream's text builder takes (bin_path, dtype, multimodal=False) and a mode per item / modes per document,
    # which it ignores; its reader answers sequence_modes None and has get/set_document_indices.
    prefix = str(tmp_path / "modes")
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16, False)
    builder.add_item(torch.tensor([4, 5]), 0)
    builder.end_document()
    builder.add_document(torch.tensor([1, 2, 3]), [2, 1], None)
    builder.finalize(prefix + ".idx")
    dataset = IndexedDataset(prefix)
    assert [dataset[i].tolist() for i in range(len(dataset))] == [[4, 5], [1, 2], [3]]
    assert dataset.sequence_modes is None and dataset.get_document_indices().tolist() == [0, 1, 3]
    dataset.set_document_indices(np.array([0, 1, 2, 3]))
    assert dataset.document_indices.tolist() == [0, 1, 2, 3] and dataset.num_documents == 3
    with pytest.raises(ValueError, match="multimodal datasets .* are not supported"):
        IndexedDatasetBuilder(str(tmp_path / "other.bin"), np.uint16, multimodal=True)
    assert not os.path.exists(tmp_path / "other.bin")


def test_no_mmap_reads_only_the_tokens_asked_for(tmp_path):
    # --no-mmap-bin-files, as upstream's file reader: a dataset far larger than memory opens and reads; neither
    # opening it nor reading a sequence holds a copy of the .bin (here 8 MB).
    import tracemalloc

    prefix = str(tmp_path / "large")
    tokens = np.arange(2_000_000, dtype=np.int32)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    builder.add_document(tokens, [1_000, 1_999_000])
    builder.finalize(prefix + ".idx")
    tracemalloc.start()
    try:
        dataset = IndexedDataset(prefix, mmap=False)
        partial = dataset.get(1, offset=1_500_000, length=5)
        first = dataset[0]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100_000, f"{peak} bytes allocated to read 1,005 tokens"
    np.testing.assert_array_equal(partial, np.arange(1_501_000, 1_501_005))
    np.testing.assert_array_equal(first, np.arange(1_000))
    np.testing.assert_array_equal(dataset.document(0), tokens)
    with open(prefix + ".bin", "r+b") as data_file:  # truncated after opening: the read says so
        data_file.truncate(4 * 1_000_000)
    with pytest.raises(IndexFileError, match=r"large\.bin ended after 0 of the 20 bytes .*truncated"):
        dataset.get(1, offset=1_500_000, length=5)


@pytest.mark.parametrize("add", ["item", "document"])
@pytest.mark.parametrize("dtype, token_ids", [(np.uint16, [5, 70000, 6]), (np.uint16, [-1, 3]),
                                              (np.int32, [2**31, 0])])
def test_builder_refuses_token_ids_its_dtype_cannot_hold(tmp_path, add, dtype, token_ids):
    # 70000 stored as uint16 would read back as 4464: a silently different token.
    import torch

    builder = IndexedDatasetBuilder(str(tmp_path / "data.bin"), dtype=dtype)
    builder.add_item(torch.tensor([1, 2, 3]))  # a tensor, as upstream's callers pass
    name = np.dtype(dtype).name
    with pytest.raises(ValueError, match=rf"token ids {min(token_ids)}\.\.{max(token_ids)} do not fit this "
                                         rf"builder's dtype {name} .* wider dtype"):
        builder.add_item(token_ids) if add == "item" else builder.add_document(token_ids, [len(token_ids)])
    builder.add_document(torch.tensor([65535, 0]), [1, 1])
    builder.finalize(str(tmp_path / "data.idx"))
    assert [sequence.tolist() for sequence in IndexedDataset(str(tmp_path / "data"))[:]] == [[1, 2, 3], [65535], [0]]


def test_upstreams_object_storage_arguments_are_accepted_as_none_and_refused_otherwise(small_dataset):
    dataset = IndexedDataset(small_dataset, multimodal=False, mmap=False, object_storage_config=None, s3_config=None)
    np.testing.assert_array_equal(dataset[0], np.arange(10))
    with pytest.raises(ValueError, match="object storage .* is not supported; copy the .bin/.idx files"):
        IndexedDataset(small_dataset, s3_config=object())

"""The --data-cache-path files: readable by whoever shares the cache directory, as the umask allows; not served
when earlier code wrote them or the data was preprocessed again; a path that cannot be the cache directory named."""

import dataclasses
import json
import os
import stat

import numpy as np
import pytest

from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, build_gpt_datasets
from megatron.core.datasets.utils import blend_from_data_path
from tests.unit_tests.datasets.gpt_test_data import EodOnlyTokenizer, write_documents


@pytest.fixture
def umask():
    """Set the process umask for one test and put the old one back."""
    previous = os.umask(0o022)
    yield os.umask
    os.umask(previous)


@pytest.mark.parametrize("mask, expected_mode", [(0o022, 0o644), (0o002, 0o664)])
def test_index_cache_files_follow_the_umask(mask, expected_mode, umask, tmp_path):
    umask(mask)
    prefixes = []
    for seed, name in enumerate(("a", "b")):
        prefixes.append(str(tmp_path / f"{name}_text_document"))
        write_documents(prefixes[-1], num_documents=20, seed=seed)
    cache = tmp_path / "cache"
    config = GPTDatasetConfig(random_seed=1, sequence_length=8, blend=blend_from_data_path(["1", prefixes[0], "3",
                              prefixes[1]]), split="9,1,0", path_to_cache=str(cache), tokenizer=EodOnlyTokenizer())
    build_gpt_datasets(config, (20, 4, 0))
    modes = {name: stat.S_IMODE(os.stat(cache / name).st_mode) for name in os.listdir(cache)}
    kinds = {name.split("-", 1)[1].rsplit("-", 1)[0] for name in modes}
    assert kinds == {"GPTDataset-train", "GPTDataset-valid", "BlendedDataset"}
    assert len(modes) == 2 * 2 * 4 + 2 * 3  # 2 datasets x 2 splits x (3 arrays + description), 2 blends x 3
    assert modes == {name: expected_mode for name in modes}
    # No temporary file is left behind, and the cache loads again.
    assert all(name.endswith((".npy", ".json")) for name in modes)
    reloaded = build_gpt_datasets(config, (20, 4, 0))[0]
    assert all(part.indices_loaded_from_cache for part in reloaded.datasets)
    assert np.array_equal(reloaded.dataset_index, build_gpt_datasets(config, (20, 4, 0))[0].dataset_index)


def test_index_files_written_by_earlier_code_are_not_served(tmp_path):
    # Earlier code cut a dataset's shuffle index to the samples asked for (now: every sample of its epochs) and
    # wrote it under the same description: a cache directory it filled must be rebuilt, not read.
    from megatron.core.datasets.utils import description_hash

    prefix = str(tmp_path / "a_text_document")
    write_documents(prefix, num_documents=20, seed=3)
    config = GPTDatasetConfig(random_seed=1, sequence_length=8, blend=blend_from_data_path([prefix]), split="1",
                              path_to_cache=str(tmp_path / "cache"), tokenizer=EodOnlyTokenizer())
    fresh = build_gpt_datasets(config, (10, 0, 0))[0]
    assert len(fresh) > 10  # every sample of the epoch
    earlier = tmp_path / "earlier_cache"
    earlier.mkdir()
    (written,) = [name for name in os.listdir(tmp_path / "cache") if name.endswith("description.json")]
    recorded = json.loads((tmp_path / "cache" / written).read_text())
    description = {key: value for key, value in recorded["description"].items() if key != "index_cache_format"}
    stem = earlier / f"{description_hash(description)}-GPTDataset-train"
    for name in ("document_index", "sample_index", "shuffle_index"):
        array = np.asarray(getattr(fresh, name))
        np.save(f"{stem}-{name}.npy", array[:10] if name == "shuffle_index" else array)
    (earlier / f"{stem.name}-description.json").write_text(json.dumps({"description": description,
                                                                      "arrays": recorded["arrays"]}))
    again = build_gpt_datasets(dataclasses.replace(config, path_to_cache=str(earlier)), (10, 0, 0))[0]
    assert not again.indices_loaded_from_cache
    assert np.array_equal(again.shuffle_index, fresh.shuffle_index) and len(again) == len(fresh)


@pytest.mark.parametrize("below_a_file", ["", "/cache"])
def test_a_cache_path_that_cannot_be_a_directory_is_named(tmp_path, below_a_file):
    prefix = str(tmp_path / "a_text_document")
    write_documents(prefix, num_documents=5, seed=3)
    (tmp_path / "notes.txt").write_text("")
    path = str(tmp_path / "notes.txt") + below_a_file
    config = GPTDatasetConfig(random_seed=1, sequence_length=8, blend=blend_from_data_path([prefix]), split="1",
                              path_to_cache=path, tokenizer=EodOnlyTokenizer())
    with pytest.raises(OSError, match=rf"--data-cache-path {path}: cannot use it as the dataset index cache "
                                      r"directory \((File exists|Not a directory)\): give a directory"):
        build_gpt_datasets(config, (4, 0, 0))


def test_data_preprocessed_again_into_files_of_the_same_sizes_gets_indices_of_its_own(tmp_path):
    # The same documents written again in another order: .bin and .idx keep their sizes, the cached sample
    # boundaries of the earlier files would cut the new documents in the wrong places.
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "a_text_document")
    documents = write_documents(prefix, num_documents=30, seed=4)
    cached = GPTDatasetConfig(random_seed=1, sequence_length=8, blend=blend_from_data_path([prefix]), split="1",
                              path_to_cache=str(tmp_path / "cache"), tokenizer=EodOnlyTokenizer(),
                              create_attention_mask=False)
    build_gpt_datasets(cached, (40, 0, 0))
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for document in documents[::-1]:
        builder.add_document(document, [len(document)])
    builder.finalize(prefix + ".idx")
    again = build_gpt_datasets(cached, (40, 0, 0))[0]
    uncached = build_gpt_datasets(dataclasses.replace(cached, path_to_cache=None), (40, 0, 0))[0]
    assert not again.indices_loaded_from_cache
    assert [again[i]["tokens"].tolist() for i in range(len(again))] == \
        [uncached[i]["tokens"].tolist() for i in range(len(uncached))]

"""The --data-cache-path files: readable by whoever shares the cache directory, as the umask allows."""

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

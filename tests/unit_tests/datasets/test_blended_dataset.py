import dataclasses

import numpy as np
import pytest
import torch

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, build_gpt_datasets
from megatron.core.datasets.utils import blend_from_data_path, build_blending_indices
from tests.unit_tests.datasets.gpt_test_data import EodOnlyTokenizer, write_documents


@pytest.mark.parametrize(
    "weights,size",
    [([0.3, 0.7], 1000), ([1, 1, 1], 301), ([0.05, 0.15, 0.8], 997), ([5, 1, 3, 1], 10), ([0.999, 0.001], 5000)],
)
def test_schedule_tracks_weights_within_one_sample(weights, size):
    dataset_index, dataset_sample_index = build_blending_indices(weights, size)
    shares = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    # After sample i is placed, each dataset is within one sample of its share of max(i, 1) samples.
    one_hot = np.eye(len(weights), dtype=np.int64)[dataset_index.astype(np.int64)]
    counts_so_far = np.cumsum(one_hot, axis=0)
    targets = np.maximum(np.arange(size), 1)[:, None] * shares[None, :]
    assert np.abs(counts_so_far - targets).max() <= 1.0
    # Sample indices within each dataset count up from zero in schedule order.
    for dataset in range(len(weights)):
        picked = dataset_sample_index[dataset_index == dataset]
        np.testing.assert_array_equal(picked, np.arange(len(picked)))


def test_schedule_is_deterministic_and_interleaved():
    first = build_blending_indices([0.5, 0.5], 8)
    second = build_blending_indices([0.5, 0.5], 8)
    np.testing.assert_array_equal(first[0], second[0])
    np.testing.assert_array_equal(first[0], [0, 1, 0, 1, 0, 1, 0, 1])


def test_schedule_is_upstreams():
    # Megatron-Core's rule: sample i goes to the dataset with the largest weight * max(i, 1) - count, ties to the
    # first. By hand for 0.25 / 0.75: i=0 (.25, .75) -> b; i=1 (.25, -.25) -> a; i=2 (-.5, .5) -> b;
    # i=3 (-.25, .25) -> b; i=4 (0, 0) tie -> a; i=5..7 -> b, b, b (errors .75, .5, .25 against -.75, -.5, -.25);
    # i=8 (0, 0) -> a; then b, b, b.
    dataset_index, dataset_sample_index = build_blending_indices([0.25, 0.75], 12)
    assert dataset_index.tolist() == [1, 0, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1]
    assert dataset_sample_index.tolist() == [0, 0, 1, 2, 1, 3, 4, 5, 2, 6, 7, 8]


class _Labelled(torch.utils.data.Dataset):
    def __init__(self, label, size):
        self.label, self.size = label, size

    def __len__(self):
        return self.size

    def __getitem__(self, idx):
        return (self.label, idx)


def test_blended_dataset_reads_the_scheduled_samples():
    blended = BlendedDataset([_Labelled("a", 40), _Labelled("b", 80)], [1, 2], 90)
    samples = [blended[i] for i in range(len(blended))]
    assert sum(1 for label, _ in samples if label == "a") == 30
    assert [idx for label, idx in samples if label == "b"] == list(range(60))
    with pytest.raises(ValueError, match="has 40 samples, the schedule needs 50"):
        BlendedDataset([_Labelled("a", 40), _Labelled("b", 80)], [1, 1], 100)


def test_blend_from_data_path_forms():
    assert blend_from_data_path(["a"]) == (["a"], None)
    assert blend_from_data_path(["a", "b"]) == (["a", "b"], None)
    assert blend_from_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    with pytest.raises(ValueError, match="--data-path"):
        blend_from_data_path(["0.3", "a", "b"])


def test_blend_of_gpt_datasets(tmp_path):
    prefixes = [str(tmp_path / name) for name in ("first", "second")]
    write_documents(prefixes[0], 30, seed=1)
    write_documents(prefixes[1], 50, seed=2)
    config = GPTDatasetConfig(
        random_seed=11,
        sequence_length=12,
        blend=blend_from_data_path(["0.25", prefixes[0], "0.75", prefixes[1]]),
        split="90,10,0",
        path_to_cache=str(tmp_path / "cache"),
        tokenizer=EodOnlyTokenizer(),
    )
    train, valid, test = build_gpt_datasets(config, (200, 21, 5))
    assert test is None
    # As upstream, each dataset is built for ceil(ceil(size * share) * 1.005) samples (--mid-level-dataset-surplus):
    # train ceil(50 * 1.005) = 51 and ceil(150 * 1.005) = 151, valid ceil(6 * 1.005) = 7 and ceil(16 * 1.005) = 17;
    # the blend holds sum(ceil(size * share)) samples: 50 + 150 for train, 6 + 16 = 22 for 21 valid samples.
    for blended, size, part_sizes in ((train, 200, [51, 151]), (valid, 22, [7, 17])):
        assert isinstance(blended, BlendedDataset) and len(blended) == size
        np.testing.assert_allclose(blended.samples_per_dataset, [0.25 * size, 0.75 * size], atol=1.0)
        assert [part.num_samples for part in blended.datasets] == part_sizes
        assert all(len(part) >= part.num_samples for part in blended.datasets)
        for i in (0, 1, 2, size - 1):
            dataset_id = int(blended.dataset_index[i])
            part = blended.datasets[dataset_id]
            sample = blended[i]
            assert sample.pop("dataset_id") == dataset_id  # upstream's BlendedDataset names each sample's source
            torch.testing.assert_close(sample, part[int(blended.dataset_sample_index[i])], rtol=0, atol=0)
    # The component datasets keep their own split documents.
    assert set(np.unique(train.datasets[0].document_index)) == set(range(27))
    assert set(np.unique(valid.datasets[1].document_index)) == set(range(45, 50))
    again, _, _ = build_gpt_datasets(config, (200, 21, 5))
    np.testing.assert_array_equal(again.dataset_index, train.dataset_index)
    assert all(part.indices_loaded_from_cache for part in again.datasets)


def test_blend_without_weights_follows_dataset_sizes(tmp_path):
    # Upstream blends `--data-path a b` in proportion to the datasets' sizes. Documents of 10 tokens at sequence
    # length 9: a (10 documents) holds (100 - 1) // 9 = 11 samples, b (30 documents) 33, so the shares are
    # 0.25 / 0.75 and the schedule is test_schedule_is_upstreams' one.
    prefixes = [str(tmp_path / "a"), str(tmp_path / "b")]
    write_documents(prefixes[0], 10, seed=1, min_length=9, max_length=9)
    write_documents(prefixes[1], 30, seed=2, min_length=9, max_length=9)
    config = GPTDatasetConfig(random_seed=3, sequence_length=9, blend=blend_from_data_path(prefixes), split="1,0,0",
                              tokenizer=EodOnlyTokenizer())
    train, _, _ = build_gpt_datasets(config, (12, 0, 0))
    np.testing.assert_allclose(train.weights, [0.25, 0.75])
    assert train.dataset_index.tolist() == [1, 0, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1]
    # Without weights no surplus: each dataset is one shuffled epoch, as upstream's.
    assert [part.num_samples for part in train.datasets] == [None, None]
    assert [len(part) for part in train.datasets] == [11, 33]


def test_upstreams_blended_dataset_arguments_with_the_config(tmp_path):
    # Upstream's BlendedDataset(datasets, weights, size, config): the config's cache keeps the schedule, and the
    # blend serves what the builder's blend of the same datasets serves.
    prefixes = [str(tmp_path / "a"), str(tmp_path / "b")]
    for seed, prefix in enumerate(prefixes):
        write_documents(prefix, num_documents=12, seed=seed)
    config = GPTDatasetConfig(random_seed=2, sequence_length=8, blend=blend_from_data_path(["1", prefixes[0], "3",
                              prefixes[1]]), split="1", tokenizer=EodOnlyTokenizer(), path_to_cache=str(tmp_path / "c"))
    built = build_gpt_datasets(config, (20, 0, 0))[0]
    own_cache = dataclasses.replace(config, path_to_cache=str(tmp_path / "own"))
    blended = BlendedDataset(built.datasets, [1, 3], len(built), own_cache)
    assert blended.config is own_cache and blended.split is built.split is built.datasets[0].split
    for index in (0, 7, len(built) - 1):
        assert torch.equal(blended[index]["tokens"], built[index]["tokens"])
        assert blended[index]["dataset_id"] == built[index]["dataset_id"]
    assert sorted(path.name.split("-", 1)[1] for path in (tmp_path / "own").iterdir()) == [
        "BlendedDataset-dataset_index.npy", "BlendedDataset-dataset_sample_index.npy",
        "BlendedDataset-description.json"]

"""The valid split for --full-validation (a count of None: the whole split, every sample once) and for
--multiple-validation-sets (one dataset per validation prefix, each as if it were the only one)."""

import numpy as np
import pytest
import torch

from megatron.core.datasets.gpt_dataset import BlendedDataset, GPTDataset, GPTDatasetConfig, build_gpt_datasets
from megatron.core.datasets.gpt_indices import samples_in_tokens
from megatron.core.datasets.utils import blend_from_data_path
from tests.unit_tests.datasets.gpt_test_data import EodOnlyTokenizer, write_documents

SEQ = 12


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("validation_splits")
    prefixes, documents = [], []
    for seed, (name, count) in enumerate((("a", 30), ("b", 50))):
        prefixes.append(str(root / f"{name}_text_document"))
        documents.append(write_documents(prefixes[-1], count, seed=seed))
    return prefixes, documents


def _config(data_path, **overrides):
    return GPTDatasetConfig(random_seed=3, sequence_length=SEQ, blend=blend_from_data_path(data_path), split="80,20,0",
                            tokenizer=EodOnlyTokenizer(), **overrides)


def _same_samples(first, second):
    assert len(first) == len(second)
    for i in range(len(first)):
        torch.testing.assert_close(first[i], second[i], rtol=0, atol=0)


def test_whole_valid_split_serves_every_sample_of_every_dataset_once(corpora):
    prefixes, documents = corpora
    # Weights are ignored for the whole split: each dataset contributes all of its samples.
    _, valid, _ = build_gpt_datasets(_config(["0.9", prefixes[0], "0.1", prefixes[1]]), (10, None, 0))
    assert isinstance(valid, BlendedDataset)
    # Counted from the documents: the valid documents are the last 20% of each dataset.
    expected = [samples_in_tokens(sum(len(doc) for doc in docs[int(0.8 * len(docs)):]), SEQ) for docs in documents]
    assert [len(part) for part in valid.datasets] == expected
    assert len(valid) == sum(expected)
    for position, count in enumerate(expected):
        served = np.asarray(valid.dataset_sample_index)[np.asarray(valid.dataset_index) == position]
        assert sorted(served.tolist()) == list(range(count))
    _, alone, _ = build_gpt_datasets(_config([prefixes[1]]), (10, None, 0))
    assert isinstance(alone, GPTDataset) and len(alone) == expected[1]


def test_multiple_validation_sets_are_each_dataset_alone(corpora):
    prefixes, _ = corpora
    config = _config(prefixes, multiple_validation_sets=True)
    train, valid, _ = build_gpt_datasets(config, (40, 8, 0))
    assert isinstance(train, BlendedDataset) and isinstance(valid, list) and len(valid) == 2
    for prefix, dataset in zip(prefixes, valid):
        _, alone, _ = build_gpt_datasets(_config([prefix]), (40, 8, 0))
        _same_samples(dataset, alone)
    whole = build_gpt_datasets(config, (40, None, 0))[1]
    for prefix, dataset in zip(prefixes, whole):
        _same_samples(dataset, build_gpt_datasets(_config([prefix]), (40, None, 0))[1])


def test_multiple_validation_sets_reject_weights_and_mock(corpora):
    prefixes, _ = corpora
    with pytest.raises(ValueError, match="--multiple-validation-sets .* without weights"):
        _config(["0.5", prefixes[0], "0.5", prefixes[1]], multiple_validation_sets=True)
    with pytest.raises(ValueError, match="--multiple-validation-sets"):
        GPTDatasetConfig(random_seed=3, sequence_length=SEQ, mock=True, tokenizer=EodOnlyTokenizer(),
                         multiple_validation_sets=True)
    mock = GPTDatasetConfig(random_seed=3, sequence_length=SEQ, mock=True, tokenizer=EodOnlyTokenizer())
    with pytest.raises(ValueError, match="--full-validation needs --data-path or --valid-data-path"):
        build_gpt_datasets(mock, (8, None, 0))

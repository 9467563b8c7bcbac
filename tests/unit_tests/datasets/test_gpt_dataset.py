import os

import numpy as np
import pytest
import torch

from megatron.core.datasets.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
    build_gpt_datasets,
    sample_from_tokens,
)
from megatron.core.datasets.gpt_indices import samples_in_tokens, separate_final_epoch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.core.datasets.utils import Split, blend_from_data_path
from megatron.training.tokenizer import NullTokenizer
from tests.unit_tests.datasets.gpt_test_data import EOD, EodOnlyTokenizer, write_documents
from tests.unit_tests.multiprocess_harness import run_on_ranks

SEQ = 16


def _config(prefix, **overrides):
    settings = dict(
        random_seed=1234,
        sequence_length=SEQ,
        blend=blend_from_data_path([prefix]),
        split="80,10,10",
        tokenizer=EodOnlyTokenizer(),
        create_attention_mask=False,
    )
    settings.update(overrides)
    return GPTDatasetConfig(**settings)


@pytest.fixture
def corpus(tmp_path):
    prefix = str(tmp_path / "corpus_text_document")
    return prefix, write_documents(prefix, num_documents=40, seed=7)


def _check_windows(dataset, documents):
    """Every sample is the window [j*SEQ, j*SEQ + SEQ + 1) of the stream of documents in document-index order."""
    stream = np.concatenate([documents[d] for d in dataset.document_index])
    assert dataset.shuffle_index.min() >= 0
    assert len(np.unique(dataset.shuffle_index)) == len(dataset)
    assert dataset.shuffle_index.max() < samples_in_tokens(len(stream), SEQ)
    for i in range(len(dataset)):
        j = int(dataset.shuffle_index[i])
        window = stream[j * SEQ : j * SEQ + SEQ + 1]
        sample = dataset[i]
        np.testing.assert_array_equal(sample["tokens"].numpy(), window[:-1])
        np.testing.assert_array_equal(sample["labels"].numpy(), window[1:])
        assert sample["tokens"].dtype == torch.int64 and sample["labels"].dtype == torch.int64
        assert sample["loss_mask"].dtype == torch.float32 and torch.all(sample["loss_mask"] == 1)
        np.testing.assert_array_equal(sample["position_ids"].numpy(), np.arange(SEQ))
        assert "attention_mask" not in sample


def test_samples_are_windows_of_the_document_stream(corpus):
    prefix, documents = corpus
    train, valid, test = build_gpt_datasets(_config(prefix), (50, 5, 3))
    for dataset, count, document_range in ((train, 50, (0, 32)), (valid, 5, (32, 36)), (test, 3, (36, 40))):
        assert dataset.document_range == document_range
        tokens_per_epoch = sum(len(documents[d]) for d in range(*document_range))
        # Enough epochs of the split's documents, each document once per epoch; all their samples are served.
        epochs = len(dataset.document_index) // (document_range[1] - document_range[0])
        assert len(dataset) == samples_in_tokens(epochs * tokens_per_epoch, SEQ) >= count
        assert samples_in_tokens((epochs - 1) * tokens_per_epoch, SEQ) < count
        np.testing.assert_array_equal(
            np.bincount(dataset.document_index, minlength=40)[range(*document_range)], epochs
        )
        _check_windows(dataset, documents)



def test_gpt_dataset_takes_upstreams_positional_arguments(corpus):
    prefix, documents = corpus
    config = _config(prefix)
    train, valid, _ = build_gpt_datasets(config, (50, 5, 3))
    indexed = IndexedDataset(prefix)
    # Upstream's order: (indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config).
    by_hand = GPTDataset(indexed, prefix, np.arange(32, 36, dtype=np.int32), 5, Split.valid, config)
    assert (by_hand.dataset, by_hand.dataset_path, by_hand.index_split) == (indexed, prefix, Split.valid)
    assert by_hand.document_range == (32, 36) and by_hand.indices.tolist() == [32, 33, 34, 35]
    np.testing.assert_array_equal(by_hand.shuffle_index, valid.shuffle_index)
    assert all(torch.equal(by_hand[i]["tokens"], valid[i]["tokens"]) for i in range(len(valid)))
    by_keyword = GPTDataset(indexed_dataset=indexed, dataset_path=None, indexed_indices=np.arange(32), num_samples=50,
                            index_split=Split.train, config=config)
    np.testing.assert_array_equal(by_keyword.document_index, train.document_index)
    # Any documents, as upstream's: the samples are windows of the stream of the documents given.
    chosen = GPTDataset(indexed, prefix, np.array([3, 17, 5, 30]), None, Split.train, config)
    assert chosen.document_range is None and sorted(chosen.document_index.tolist()) == [3, 5, 17, 30]
    _check_windows(chosen, documents)
    with pytest.raises(TypeError, match=r"GPTDataset takes upstream's arguments \(indexed_dataset, dataset_path, "
                                        r"indexed_indices, num_samples, index_split, config\)"):
        GPTDataset(indexed, config, Split.train, (0, 32), 50)


def test_upstreams_low_level_dataset_helpers(corpus):
    # Upstream's builder opens each prefix and sizes its splits with these two static methods.
    prefix, documents = corpus
    config = _config(prefix, mmap_bin_files=False)
    indexed = GPTDataset.build_low_level_dataset(prefix, config)
    assert isinstance(indexed, IndexedDataset) and not indexed.mmap and indexed.path_prefix == prefix
    assert GPTDataset.numel_low_level_dataset(indexed) == len(documents) == 40
    np.testing.assert_array_equal(indexed[7], documents[7])


def test_consecutive_samples_share_one_token(corpus):
    prefix, _ = corpus
    train, _, _ = build_gpt_datasets(_config(prefix, split="1,0,0"), (30, 0, 0))
    windows = [train.token_window(j) for j in range(len(train) - 1)]
    for first, second in zip(windows, windows[1:]):
        assert len(first) == SEQ + 1
        assert first[-1] == second[0]


def test_final_partial_epoch_is_shuffled_separately(corpus):
    prefix, documents = corpus
    config = _config(prefix, split="1,0,0")
    tokens_per_epoch = sum(map(len, documents))
    per_epoch = samples_in_tokens(tokens_per_epoch, SEQ)
    requested = samples_in_tokens(2 * tokens_per_epoch, SEQ) + per_epoch // 4  # a quarter of a third epoch
    train, _, _ = build_gpt_datasets(config, (requested, 0, 0))
    assert len(train) == samples_in_tokens(3 * tokens_per_epoch, SEQ)  # all of the three epochs, as upstream
    before_final = samples_in_tokens(2 * tokens_per_epoch, SEQ)
    # The last epoch's documents are a permutation of their own, after two shuffled epochs.
    np.testing.assert_array_equal(np.sort(train.document_index[-40:]), np.arange(40))
    np.testing.assert_array_equal(np.bincount(train.document_index[:-40]), np.full(40, 2))
    # Every sample of the first two epochs is served, then the third's.
    np.testing.assert_array_equal(np.sort(train.shuffle_index[:before_final]), np.arange(before_final))
    assert np.all(train.shuffle_index[before_final:] >= before_final)
    _check_windows(train, documents)


def test_final_epoch_threshold_counts_whole_samples():
    # 30 tokens of sequence length 4 hold 7 samples an epoch; 12 samples need a second epoch and use 5 of it.
    # Upstream separates the final epoch below int(0.8 * 7) = 5 samples, so 5 is not separated and 4 is.
    assert samples_in_tokens(30, 4) == 7 and samples_in_tokens(60, 4) == 14
    assert not separate_final_epoch(30, 4, 12, 2)
    assert separate_final_epoch(30, 4, 11, 2)


def test_splits_are_disjoint_by_document(corpus):
    prefix, _ = corpus
    datasets = build_gpt_datasets(_config(prefix, split="6,2,2"), (20, 20, 20))
    seen = [set(np.unique(dataset.document_index).tolist()) for dataset in datasets]
    assert [len(documents) for documents in seen] == [24, 8, 8]
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])
    assert seen[0] | seen[1] | seen[2] == set(range(40))


def test_zero_share_split_is_none(corpus):
    prefix, _ = corpus
    train, valid, test = build_gpt_datasets(_config(prefix, split="9,1,0"), (10, 0, 5))
    assert train.num_samples == 10 and len(train) >= 10 and valid is None and test is None


def test_index_cache_is_reused(corpus, tmp_path):
    prefix, _ = corpus
    cache = str(tmp_path / "cache")
    config = _config(prefix, path_to_cache=cache)
    first = build_gpt_datasets(config, (40, 5, 3))
    files = sorted(os.listdir(cache))
    assert len([name for name in files if name.endswith(".npy")]) == 9
    second = build_gpt_datasets(config, (40, 5, 3))
    assert sorted(os.listdir(cache)) == files
    for built, loaded in zip(first, second):
        assert not built.indices_loaded_from_cache and loaded.indices_loaded_from_cache
        for name in ("document_index", "sample_index", "shuffle_index"):
            np.testing.assert_array_equal(getattr(built, name), getattr(loaded, name))
        torch.testing.assert_close(built[2], loaded[2], rtol=0, atol=0)
    # Another seed is another cache entry with other indices.
    reseeded = build_gpt_datasets(_config(prefix, path_to_cache=cache, random_seed=99), (40, 5, 3))[0]
    assert not reseeded.indices_loaded_from_cache
    assert not np.array_equal(reseeded.shuffle_index, first[0].shuffle_index)


def test_same_seed_same_samples_without_cache(corpus):
    prefix, _ = corpus
    first, _, _ = build_gpt_datasets(_config(prefix), (25, 0, 0))
    second, _, _ = build_gpt_datasets(_config(prefix), (25, 0, 0))
    for i in range(25):
        torch.testing.assert_close(first[i], second[i], rtol=0, atol=0)


def _reference_positions_and_mask(tokens):
    """Position ids and allowed-attention matrix computed position by position."""
    positions, allowed = [], np.zeros((len(tokens), len(tokens)), dtype=bool)
    document_start = 0
    for query in range(len(tokens)):
        positions.append(query - document_start)
        for key in range(document_start, query + 1):
            allowed[query, key] = True
        if tokens[query] == EOD:
            document_start = query + 1
    return np.array(positions), allowed


def test_eod_features(tmp_path):
    prefix = str(tmp_path / "short_docs")
    write_documents(prefix, num_documents=30, seed=3, max_length=6)
    config = _config(
        prefix,
        split="1,0,0",
        reset_position_ids=True,
        reset_attention_mask=True,
        eod_mask_loss=True,
        create_attention_mask=True,
    )
    train, _, _ = build_gpt_datasets(config, (8, 0, 0))
    eods_seen = 0
    for i in range(len(train)):
        sample = train[i]
        tokens = sample["tokens"].numpy()
        eods_seen += int((tokens == EOD).sum())
        positions, allowed = _reference_positions_and_mask(tokens)
        np.testing.assert_array_equal(sample["position_ids"].numpy(), positions)
        np.testing.assert_array_equal(sample["loss_mask"].numpy(), (tokens != EOD).astype(np.float32))
        assert sample["attention_mask"].shape == (1, SEQ, SEQ) and sample["attention_mask"].dtype == torch.bool
        np.testing.assert_array_equal(sample["attention_mask"][0].numpy(), ~allowed)
    assert eods_seen > 8  # short documents: the features were exercised


def test_causal_mask_without_reset(corpus):
    prefix, _ = corpus
    train, _, _ = build_gpt_datasets(_config(prefix, create_attention_mask=True), (2, 0, 0))
    mask = train[0]["attention_mask"][0]
    np.testing.assert_array_equal(mask.numpy(), np.triu(np.ones((SEQ, SEQ), dtype=bool), k=1))


def test_missing_data_path_names_flag_and_files(tmp_path):
    existing = str(tmp_path / "present")
    write_documents(existing, 5, seed=0)
    missing = str(tmp_path / "absent_text_document")
    config = _config(existing, blend=blend_from_data_path(["0.5", existing, "0.5", missing]))
    with pytest.raises(FileNotFoundError, match=r"--data-path.*absent_text_document\.idx.*absent_text_document\.bin"):
        build_gpt_datasets(config, (10, 0, 0))


def test_an_empty_dataset_is_named_as_empty(corpus, tmp_path):
    empty = str(tmp_path / "empty_text_document")
    write_documents(empty, num_documents=0, seed=0)
    config = _config(corpus[0], blend=blend_from_data_path(["0.5", empty, "0.5", corpus[0]]))
    with pytest.raises(ValueError, match=r"empty_text_document holds no tokens \(0 documents.*drop it from the data"):
        build_gpt_datasets(config, (10, 2, 2))
    builder = IndexedDatasetBuilder(empty + ".bin", dtype=np.uint16)  # what preprocessing writes for empty texts
    for _ in range(3):
        builder.add_document([], [])
    builder.finalize(empty + ".idx")
    with pytest.raises(ValueError, match=r"empty_text_document holds no tokens \(3 documents, all empty"):
        build_gpt_datasets(config, (10, 2, 2))


def test_config_errors_name_flags(tmp_path):
    with pytest.raises(ValueError, match="--data-path"):
        build_gpt_datasets(GPTDatasetConfig(random_seed=1, sequence_length=8), (1, 0, 0))
    with pytest.raises(ValueError, match="--split"):
        GPTDatasetConfig(random_seed=1, sequence_length=8, blend=(["x"], None), split="a,b")
    with pytest.raises(ValueError, match="--seq-length"):
        GPTDatasetConfig(random_seed=1, sequence_length=0, blend=(["x"], None))
    with pytest.raises(ValueError, match="--mock-data"):
        GPTDatasetConfig(random_seed=1, sequence_length=8, mock=True)
    with pytest.raises(ValueError, match="weights"):
        GPTDatasetConfig(random_seed=1, sequence_length=8, blend=(["x", "y"], [1.0]), split="1")
    config = GPTDatasetConfig(random_seed=1, sequence_length=8, blend=(["x"], None), split="1")
    with pytest.raises(Exception):
        config.sequence_length = 4  # frozen


def test_mock_dataset_is_deterministic():
    config = GPTDatasetConfig(random_seed=5, sequence_length=SEQ, mock=True, tokenizer=NullTokenizer(50))
    train, valid, test = build_gpt_datasets(config, (6, 4, 0))
    assert isinstance(train, MockGPTDataset) and (len(train), len(valid), test) == (6, 4, None)
    again = MockGPTDataset(None, None, None, 6, Split.train, config)
    for i in range(6):
        sample = train[i]
        torch.testing.assert_close(sample, again[i], rtol=0, atol=0)
        assert sample["tokens"].shape == (SEQ,)
        # The text ids 0..49 of --vocab-size 50; never the eod 50.
        assert 0 <= int(sample["tokens"].min()) and int(sample["tokens"].max()) < config.tokenizer.eod == 50
        torch.testing.assert_close(sample["tokens"][1:], sample["labels"][:-1], rtol=0, atol=0)
    assert not torch.equal(train[0]["tokens"], valid[0]["tokens"])
    other_seed = MockGPTDataset(None, None, None, 6, Split.train, GPTDatasetConfig(
        random_seed=6, sequence_length=SEQ, mock=True, tokenizer=NullTokenizer(50)))
    assert not torch.equal(train[0]["tokens"], other_seed[0]["tokens"])


class _MidVocabularyEodTokenizer:
    """An eod that is not the last id (as a tokenizer whose special tokens come first)."""

    eod = 2
    vocab_size = 6



def test_mock_gpt_dataset_takes_upstreams_positional_arguments():
    config = GPTDatasetConfig(random_seed=5, sequence_length=SEQ, mock=True, tokenizer=NullTokenizer(50))
    _, valid, _ = build_gpt_datasets(config, (6, 4, 0))
    by_hand = MockGPTDataset(None, None, None, 4, Split.valid, config)
    assert (len(by_hand), by_hand.index_split) == (4, Split.valid)
    assert all(torch.equal(by_hand[i]["tokens"], valid[i]["tokens"]) for i in range(4))
    with pytest.raises(TypeError, match=r"MockGPTDataset takes upstream's arguments \(dataset, dataset_path, indices, "
                                        r"num_samples, index_split, config\)"):
        MockGPTDataset(config, Split.train, 4)


@pytest.mark.parametrize("tokenizer, drawn_ids", [
    (NullTokenizer(5), [0, 1, 2, 3, 4]),  # the text ids of --vocab-size 5, below its eod 5
    (_MidVocabularyEodTokenizer(), [0, 1, 3, 4, 5]),
])
def test_mock_dataset_draws_every_id_but_the_eod(tokenizer, drawn_ids):
    dataset = MockGPTDataset(None, None, None, 4, Split.train,
                             GPTDatasetConfig(random_seed=3, sequence_length=63, mock=True, tokenizer=tokenizer))
    assert np.unique(np.concatenate([dataset.token_window(i) for i in range(4)])).tolist() == drawn_ids


def test_mock_dataset_rejects_an_eod_outside_the_vocabulary():
    tokenizer = _MidVocabularyEodTokenizer()
    tokenizer.eod = 6
    with pytest.raises(ValueError, match=r"--mock-data needs the tokenizer's eod id \(6\) inside"):
        MockGPTDataset(None, None, None, 1, Split.train,
                       GPTDatasetConfig(random_seed=3, sequence_length=8, mock=True, tokenizer=tokenizer))


def test_null_tokenizer_last_text_id_is_text_and_the_next_id_ends_documents():
    """Pre-tokenized data for --vocab-size 50 may use id 49 as text; only 50, the eod, closes a document."""
    tokenizer = NullTokenizer(50)
    documents = ["7 49 3", "49 49", "0 12 49 5"]
    window = np.array([token for text in documents for token in tokenizer.tokenize(text) + [tokenizer.eod]])
    np.testing.assert_array_equal(window, [7, 49, 3, 50, 49, 49, 50, 0, 12, 49, 5, 50])
    config = GPTDatasetConfig(random_seed=1, sequence_length=len(window) - 1, blend=(["unused"], None),
                              split="1", tokenizer=tokenizer, eod_mask_loss=True, reset_position_ids=True,
                              reset_attention_mask=True, create_attention_mask=True)
    sample = sample_from_tokens(window, config)
    np.testing.assert_array_equal(sample["loss_mask"].numpy(), [1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(sample["position_ids"].numpy(), [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3])
    document_of_position = np.array([0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2])
    allowed = np.tril(document_of_position[:, None] == document_of_position[None, :])
    np.testing.assert_array_equal(sample["attention_mask"][0].numpy(), ~allowed)


def _build_on_ranks_with_shared_cache(prefix, cache):
    train, _, _ = build_gpt_datasets(_config(prefix, path_to_cache=cache), (30, 0, 0))
    return train.indices_loaded_from_cache, train.shuffle_index.tolist(), train[7]["tokens"].tolist()


@pytest.mark.parametrize("world_size", [2])
def test_rank_zero_builds_cache_others_load(world_size, corpus, tmp_path):
    prefix, _ = corpus
    results = run_on_ranks(world_size, _build_on_ranks_with_shared_cache, prefix, str(tmp_path / "shared_cache"))
    assert results[0][0] is False and all(loaded for loaded, _, _ in results[1:])
    assert all(result[1:] == results[0][1:] for result in results)

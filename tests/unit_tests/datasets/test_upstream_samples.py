"""What a Megatron-Core user sees of a sample: padding ids get no loss, the `idx is None` padding sample, a blend's
`dataset_id`, and upstream's GPTDatasetConfig keywords."""

import argparse

import numpy as np
import pytest
import torch

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import (
    PAD_TOKEN_ID,
    GPTDatasetConfig,
    MockGPTDataset,
    build_gpt_datasets,
    pad_token_id,
    sample_from_tokens,
)
from megatron.core.datasets.utils import Split, blend_from_data_path
from megatron.training.tokenizer import NullTokenizer
from tests.unit_tests.datasets.gpt_test_data import EOD, EodOnlyTokenizer, write_documents


class _TokenizerWithPad(EodOnlyTokenizer):
    pad = 3


def _upstream_keywords(**overrides):
    """The keywords upstream's examples and pretrain_gpt.py pass."""
    settings = dict(random_seed=0, sequence_length=8, reset_position_ids=False, reset_attention_mask=False,
                    eod_mask_loss=False, tokenizer=NullTokenizer(64), mid_level_dataset_surplus=0.005)
    settings.update(overrides)
    return settings


def test_labels_equal_to_the_tokenizers_own_pad_id_get_no_loss():
    config = GPTDatasetConfig(random_seed=0, sequence_length=7, blend=(["unused"], None), split="1",
                              tokenizer=_TokenizerWithPad(), create_attention_mask=False)
    window = np.array([5, 3, 3, 7, EOD, 3, 8, 9])
    sample = sample_from_tokens(window, config)
    # Labels are [3, 3, 7, EOD, 3, 8, 9]: positions 0, 1 and 4 are padding; pad ids read as 0 in tokens and labels.
    np.testing.assert_array_equal(sample["loss_mask"].numpy(), [0, 0, 1, 1, 0, 1, 1])
    np.testing.assert_array_equal(sample["tokens"].numpy(), [5, 0, 0, 7, EOD, 0, 8])
    np.testing.assert_array_equal(sample["labels"].numpy(), [0, 0, 7, EOD, 0, 8, 9])
    assert sample["tokens"].dtype == torch.int64 and sample["loss_mask"].dtype == torch.float32


def test_a_pad_that_is_the_eod_is_no_padding_token():
    # NullTokenizer answers pad with its eod (upstream's has no pad): eod labels keep their loss, as upstream's.
    tokenizer = NullTokenizer(10)
    assert tokenizer.pad == tokenizer.eod == 10
    assert pad_token_id(tokenizer) == PAD_TOKEN_ID == -1
    assert pad_token_id(EodOnlyTokenizer()) == -1 and pad_token_id(_TokenizerWithPad()) == 3
    config = GPTDatasetConfig(random_seed=0, sequence_length=5, blend=(["unused"], None), split="1",
                              tokenizer=tokenizer)
    sample = sample_from_tokens(np.array([1, 10, 2, 10, 4, 10]), config)
    np.testing.assert_array_equal(sample["loss_mask"].numpy(), [1, 1, 1, 1, 1])
    np.testing.assert_array_equal(sample["labels"].numpy(), [10, 2, 10, 4, 10])


def test_none_is_the_padding_sample_with_no_loss(tmp_path):
    prefix = str(tmp_path / "corpus")
    write_documents(prefix, num_documents=20, seed=3)
    config = GPTDatasetConfig(random_seed=5, sequence_length=8, blend=blend_from_data_path([prefix]), split="1",
                              tokenizer=EodOnlyTokenizer(), create_attention_mask=False)
    train, _, _ = build_gpt_datasets(config, (6, 0, 0))
    mock = MockGPTDataset(None, None, None, 4, Split.train,
                          GPTDatasetConfig(random_seed=5, sequence_length=8, mock=True, tokenizer=NullTokenizer(16)))
    for dataset in (train, mock):
        padding, first = dataset[None], dataset[0]
        assert set(padding) == set(first)
        assert torch.equal(padding["tokens"], first["tokens"]) and torch.equal(padding["labels"], first["labels"])
        assert torch.equal(first["loss_mask"], torch.ones(8)) and torch.equal(padding["loss_mask"], torch.zeros(8))


def _quarter_three_quarters_blend(tmp_path):
    """The train split of a 0.25 / 0.75 blend of two 30-document datasets, 8 samples."""
    prefixes = [str(tmp_path / name) for name in ("a", "b")]
    for seed, prefix in enumerate(prefixes):
        write_documents(prefix, num_documents=30, seed=seed)
    config = GPTDatasetConfig(random_seed=2, sequence_length=8, split="1",
                              blend=blend_from_data_path(["0.25", prefixes[0], "0.75", prefixes[1]]),
                              tokenizer=EodOnlyTokenizer(), create_attention_mask=False)
    return build_gpt_datasets(config, (8, 0, 0))[0]


def test_blended_samples_carry_their_dataset_id(tmp_path):
    train = _quarter_three_quarters_blend(tmp_path)
    assert isinstance(train, BlendedDataset)
    # Upstream's schedule for 0.25 / 0.75 (test_schedule_is_upstreams): b, a, b, b, a, b, b, b.
    assert [int(train[i]["dataset_id"]) for i in range(8)] == [1, 0, 1, 1, 0, 1, 1, 1]
    assert train[1]["dataset_id"].dtype == np.int16
    torch.testing.assert_close(train[1]["tokens"], train.datasets[0][0]["tokens"], rtol=0, atol=0)
    batch = next(iter(torch.utils.data.DataLoader(train, batch_size=4)))
    assert batch["dataset_id"].dtype == torch.int16 and batch["dataset_id"].tolist() == [1, 0, 1, 1]


def test_negative_indices_count_from_the_end_as_numpys(tmp_path):
    blend = _quarter_three_quarters_blend(tmp_path)
    mock = MockGPTDataset(None, None, None, 4, Split.train,
                          GPTDatasetConfig(random_seed=5, sequence_length=8, mock=True, tokenizer=NullTokenizer(16)))
    for dataset in (blend, blend.datasets[1], mock):
        size = len(dataset)
        for key in ("tokens", "labels", "loss_mask"):
            assert torch.equal(dataset[-1][key], dataset[size - 1][key])
            assert torch.equal(dataset[-size][key], dataset[0][key])
        with pytest.raises(IndexError, match=f"sample {-size - 1} out of range for .* of {size} samples"):
            dataset[-size - 1]
        with pytest.raises(IndexError, match=f"sample {size} out of range"):
            dataset[size]


def test_pretrain_gpt_get_batch_keeps_the_model_inputs_only(monkeypatch, tmp_path):
    # A blend's dataset_id ([b]) must not reach the context-parallel split of [b, s] tensors.
    import pretrain_gpt
    from megatron.core.transformer.context_parallel.sequence_split import get_batch_on_this_cp_rank

    monkeypatch.setattr(pretrain_gpt, "get_args", lambda: argparse.Namespace(device="cpu"))
    monkeypatch.setattr(pretrain_gpt, "get_batch_on_this_cp_rank",
                        lambda batch: get_batch_on_this_cp_rank(batch, cp_size=2, cp_rank=1))
    tokens = torch.arange(16).view(2, 8)
    batch = {"dataset_id": torch.tensor([1, 0], dtype=torch.int16), "tokens": tokens, "labels": tokens + 1,
             "loss_mask": torch.ones(2, 8), "position_ids": torch.arange(8).expand(2, 8)}
    local = pretrain_gpt.get_batch(iter([batch]))
    assert set(local) == {"tokens", "labels", "loss_mask", "position_ids"}
    # CP rank 1 of 2 holds chunks 1 and 2 of 4: positions 2, 3, 4, 5.
    assert local["tokens"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert local["position_ids"].tolist() == [[2, 3, 4, 5], [2, 3, 4, 5]]


def test_upstream_mock_config_keywords_build_mock_data():
    config = GPTDatasetConfig(**_upstream_keywords(split=None, full_validation=False,
                                                   add_extra_token_to_sequence=True,
                                                   drop_last_partial_validation_sequence=True,
                                                   object_storage_cache_path=None))
    assert config.split is None and config.split_matrix == [(0.0, 1 / 3), (1 / 3, 2 / 3), (2 / 3, 1.0)]
    train, valid, test = BlendedMegatronDatasetBuilder(MockGPTDataset, [5, 2, None], lambda: True, config).build()
    assert (len(train), len(valid), test) == (5, 2, None)


def test_split_matrix_is_upstreams():
    config = GPTDatasetConfig(**_upstream_keywords(blend=(["unused"], None), split="90,10,0"))
    assert config.split_matrix == [(0.0, 0.9), (0.9, 1.0), None]
    per_split = GPTDatasetConfig(**_upstream_keywords(split=None, blend_per_split=[(["a"], None), None, None]))
    assert per_split.split_matrix is None


def test_split_and_blend_per_split_are_exclusive_as_upstream():
    # Upstream's config asserts "split and blend_per_split are incompatible"; its split defaults to None.
    assert GPTDatasetConfig(random_seed=1, sequence_length=8, blend_per_split=[(["a"], None), None, None]).split is None
    with pytest.raises(ValueError, match=r"split \('90,10,0', --split\) and blend_per_split \(--train-data-path / "
                                         r"--valid-data-path / --test-data-path\) are exclusive, as upstream's: .* "
                                         r"leave split None \(drop --split\)"):
        GPTDatasetConfig(random_seed=1, sequence_length=8, split="90,10,0",
                         blend_per_split=[(["a"], None), None, None])


@pytest.mark.parametrize("keyword,value,message", [
    ("add_extra_token_to_sequence", False, "add_extra_token_to_sequence=False .* not supported: leave it True"),
    ("drop_last_partial_validation_sequence", False,
     "drop_last_partial_validation_sequence=False .* not supported: leave it True"),
    ("object_storage_cache_path", "/cache", "object storage .* copy the .bin/.idx files"),
])
def test_unsupported_upstream_values_are_refused_saying_what_to_do(keyword, value, message):
    with pytest.raises(ValueError, match=message):
        GPTDatasetConfig(**_upstream_keywords(**{keyword: value}))


def test_a_blend_without_split_is_refused():
    with pytest.raises(ValueError, match=r"a blend \(--data-path\) needs split, e.g. split='969,30,1'"):
        GPTDatasetConfig(**_upstream_keywords(blend=(["a"], None), split=None))

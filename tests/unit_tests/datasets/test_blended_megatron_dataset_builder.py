"""Upstream's dataset entry points: BlendedMegatronDatasetBuilder over mock and real data, a config without data,
the attention mask by default, compile_helpers and _NullTokenizer."""

import pytest
import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import compile_helpers
from megatron.training.tokenizer.tokenizer import _NullTokenizer

SEQ = 8


def _upstream_config():
    return GPTDatasetConfig(random_seed=0, sequence_length=SEQ, reset_position_ids=False, reset_attention_mask=False,
                            eod_mask_loss=False, tokenizer=_NullTokenizer(vocab_size=64))


def test_mock_datasets_from_a_config_without_data():
    compile_helpers()
    train, valid, test = BlendedMegatronDatasetBuilder(MockGPTDataset, [10, None, None], lambda: True,
                                                       _upstream_config()).build()
    assert isinstance(train, MockGPTDataset) and len(train) == 10 and valid is None and test is None
    sample = train[3]
    assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids", "attention_mask"}
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1]) and int(sample["tokens"].max()) < 64
    causal_masked_out = ~torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool))
    assert torch.equal(sample["attention_mask"], causal_masked_out.unsqueeze(0))


def test_builder_skips_ranks_and_refuses_what_it_cannot_build():
    config = _upstream_config()
    assert BlendedMegatronDatasetBuilder(MockGPTDataset, [4, 2, 0], lambda: False, config).build() == [None] * 3
    with pytest.raises(ValueError, match="--data-path"):
        BlendedMegatronDatasetBuilder(GPTDataset, [4, None, None], lambda: True, config).build()
    mock = GPTDatasetConfig(random_seed=0, sequence_length=SEQ, mock=True, tokenizer=_NullTokenizer(8))
    with pytest.raises(ValueError, match="build MockGPTDataset"):
        BlendedMegatronDatasetBuilder(GPTDataset, [4, None, None], lambda: True, mock)
    with pytest.raises(TypeError, match="GPTDataset or MockGPTDataset"):
        BlendedMegatronDatasetBuilder(torch.utils.data.TensorDataset, [4, 0, 0], lambda: True, config)

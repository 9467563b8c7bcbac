"""A Hugging Face pad token that is an ordinary token (one plain text encodes to) is no padding id: the GPT dataset
keeps that token and its loss, as with upstream's legacy HuggingFaceTokenizer (no `pad`). A pad token of its own
(`<pad>`, which text never encodes to) stays the padding id."""

import json
import types

import numpy as np
import pytest

from megatron.core.datasets.gpt_dataset import PAD_TOKEN_ID, pad_token_id, sample_from_tokens
from megatron.training.tokenizer import build_tokenizer
from megatron.training.tokenizer.bpe_training import train_bpe_tokenizer
from tests.unit_tests.tokenizer.test_upstream_parity import CORPUS

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


def _sample(tokenizer, ids):
    config = types.SimpleNamespace(tokenizer=tokenizer, eod_mask_loss=False, reset_position_ids=False,
                                   reset_attention_mask=False, create_attention_mask=False)
    return sample_from_tokens(np.array(ids), config)


def _save_directory(directory, pad_token):
    backend = train_bpe_tokenizer(CORPUS, vocab_size=300, min_frequency=1)  # <|endoftext|> 0, <pad> 1
    pretrained = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                                                      pad_token=pad_token)
    pretrained.save_pretrained(str(directory))
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def test_an_ordinary_pad_token_keeps_its_loss_and_id(tmp_path):
    reference = _save_directory(tmp_path, pad_token="!")
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    exclamation = reference.pad_token_id
    assert reference.encode("!", add_special_tokens=False) == [exclamation] and exclamation != reference.eos_token_id
    assert tokenizer.pad == tokenizer.eod == reference.eos_token_id == 0
    assert pad_token_id(tokenizer) == PAD_TOKEN_ID
    ids = tokenizer.tokenize("Hello world! It's a test!") + [tokenizer.eod]
    assert ids.count(exclamation) == 2
    sample = _sample(tokenizer, ids)
    assert sample["tokens"].tolist() == ids[:-1] and sample["labels"].tolist() == ids[1:]
    assert sample["loss_mask"].tolist() == [1.0] * (len(ids) - 1)


def test_a_pad_token_of_its_own_is_the_padding_id(tmp_path):
    reference = _save_directory(tmp_path, pad_token="<pad>")
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert tokenizer.pad == reference.pad_token_id == 1 and tokenizer.eod == 0
    assert tokenizer.tokenize("<pad>") == [1]  # the spelled-out special token, as AutoTokenizer reads it
    sample = _sample(tokenizer, [5, 6, 1, 1])
    assert sample["loss_mask"].tolist() == [1.0, 0.0, 0.0] and sample["labels"].tolist() == [6, 0, 0]


def test_a_bare_tokenizer_json_whose_pad_spelling_is_a_word(tmp_path):
    vocabulary = {"<|endoftext|>": 0, "<pad>": 1, "hello": 2, "[UNK]": 3}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "tokenizer.json"
    backend.save(str(path))
    assert json.loads(path.read_text())["added_tokens"] == []
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(path))
    assert tokenizer.tokenize("hello <pad> hello") == [2, 1, 2]  # text holds the word <pad>: a real token
    assert tokenizer.pad == tokenizer.eod == 0
    assert _sample(tokenizer, [2, 1, 2, 0])["loss_mask"].tolist() == [1.0, 1.0, 1.0]

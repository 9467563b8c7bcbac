import pytest

from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, build_gpt_datasets
from megatron.core.datasets.utils import blend_from_data_path
from tests.unit_tests.datasets.gpt_test_data import EodOnlyTokenizer, write_documents


def test_weights_and_prefixes_quoted_as_one_argument_are_named(tmp_path):
    first, second = str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")
    write_documents(first, num_documents=10, seed=1)
    write_documents(second, num_documents=10, seed=2)
    quoted = f"0.3 {first} 0.7 {second}"  # what `--data-path "0.3 A 0.7 B"` passes: one word
    config = GPTDatasetConfig(random_seed=1, sequence_length=8, blend=blend_from_data_path([quoted]), split="1",
                              tokenizer=EodOnlyTokenizer())
    with pytest.raises(FileNotFoundError) as error:
        build_gpt_datasets(config, (4, 0, 0))
    assert f"{quoted!r} looks like several words passed as one argument" in str(error.value)
    assert "--data-path 0.3 A 0.7 B, not one quoted string" in str(error.value)
    config = GPTDatasetConfig(random_seed=1, sequence_length=8, blend=blend_from_data_path(quoted.split()), split="1",
                              tokenizer=EodOnlyTokenizer())
    assert len(build_gpt_datasets(config, (4, 0, 0))[0]) == 5  # ceil(4 x 0.3) + ceil(4 x 0.7), as upstream


def test_a_missing_prefix_without_spaces_gets_no_quoting_hint(tmp_path):
    config = GPTDatasetConfig(random_seed=1, sequence_length=8, blend=([str(tmp_path / "missing")], None),
                              split="1", tokenizer=EodOnlyTokenizer())
    with pytest.raises(FileNotFoundError) as error:
        build_gpt_datasets(config, (4, 0, 0))
    assert "missing.idx" in str(error.value) and "quoted" not in str(error.value)

"""A `--data-path` prefix whose .bin / .idx files are missing stops the run before the model is built (and before a
checkpoint is loaded), with the dataset builder's message naming --data-path."""

import pytest

from megatron.training import training
from megatron.training.arguments import parse_args, validate_args

TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--train-iters", "2", "--lr", "1e-3", "--tokenizer-type", "NullTokenizer", "--vocab-size", "63"]


def _never_built(*args, **kwargs):
    raise AssertionError("the model was built before the data files were checked")


@pytest.mark.parametrize("paths", [["--data-path", "{tmp}/missing_text_document"],
                                   ["--data-path", "0.5", "{tmp}/present", "0.5", "{tmp}/missing_text_document"],
                                   ["--train-data-path", "{tmp}/missing_text_document", "--valid-data-path",
                                    "{tmp}/present"]])
def test_missing_dataset_files_stop_the_run_before_the_model_is_built(tmp_path, paths):
    for suffix in (".bin", ".idx"):
        (tmp_path / f"present{suffix}").write_bytes(b"")
    flags = TINY + [path.format(tmp=tmp_path) for path in paths]
    args = validate_args(parse_args(args=flags))
    with pytest.raises(FileNotFoundError, match=r"--data-path names datasets whose files do not exist: .*missing"):
        training._pretrain(None, _never_built, None, args)


def test_mock_data_needs_no_files():
    args = validate_args(parse_args(args=TINY + ["--mock-data"]))
    training._check_data_files_before_building(args)  # nothing to check, nothing raised

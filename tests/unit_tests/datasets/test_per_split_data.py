"""Upstream data flags end to end from the command line to the samples: --train/valid/test-data-path (also from
--per-split-data-args-path), --data-args-path, --no-mmap-bin-files, --num-dataset-builder-threads, and the
check that a provider which ignores one of them fails naming it."""

import json

import numpy as np
import pytest

from megatron.core.datasets.gpt_dataset import BlendedDataset, GPTDatasetConfig, build_gpt_datasets
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.training.arguments import parse_args, validate_args
from megatron.training.datasets.gpt_dataset_config import check_datasets_follow_flags, gpt_dataset_config_from_args
from megatron.training.tokenizer import NullTokenizer

VOCAB_SIZE = 100
EOD = NullTokenizer(VOCAB_SIZE).eod  # ends every document written here
# Each dataset's tokens come from its own id range, so a sample tells which dataset it was read from.
TOKEN_RANGES = {"a": (0, 20), "b": (20, 40), "c": (40, 60), "d": (60, 80)}
COUNTS = [40, 16, 8]


def _write(prefix, low, high, seed):
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(40):
        document = np.append(rng.integers(low, high, size=int(rng.integers(5, 25))), EOD)
        builder.add_document(document, [len(document)])
    builder.finalize(prefix + ".idx")


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    root = tmp_path_factory.mktemp("per_split")
    paths = {}
    for seed, (name, (low, high)) in enumerate(TOKEN_RANGES.items()):
        paths[name] = str(root / f"{name}_text_document")
        _write(paths[name], low, high, seed)
    return paths


def _args(extra):
    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
            "--global-batch-size 8 --train-iters 4 --lr 1e-3 --tokenizer-type NullTokenizer "
            f"--vocab-size {VOCAB_SIZE}").split()
    return validate_args(parse_args(args=base + extra))


def _datasets(args):
    config = gpt_dataset_config_from_args(args, NullTokenizer(VOCAB_SIZE))
    return config, build_gpt_datasets(config, COUNTS)


def _source_of(sample):
    tokens = sample["tokens"][sample["tokens"] != EOD]
    sources = {name for name, (low, high) in TOKEN_RANGES.items() if ((tokens >= low) & (tokens < high)).any()}
    return sources


def test_per_split_paths_give_each_split_the_datasets_named(prefixes):
    args = _args(["--train-data-path", "0.25", prefixes["a"], "0.75", prefixes["d"],
                  "--valid-data-path", prefixes["b"], "--test-data-path", prefixes["c"]])
    config, (train, valid, test) = _datasets(args)
    assert config.blend is None and config.blend_per_split[1] == ((prefixes["b"],), None)
    assert isinstance(train, BlendedDataset) and len(train) == 40
    assert np.bincount(np.asarray(train.dataset_index)).tolist() == [10, 30]  # 0.25 / 0.75 of 40
    train_sources = [_source_of(train[i]) for i in range(len(train))]
    assert all(sources <= {"a", "d"} for sources in train_sources)
    assert sum(sources == {"a"} for sources in train_sources) == 10
    assert len(valid) >= 16 and len(test) >= 8  # a single prefix serves all the samples of its epochs
    assert [_source_of(valid[i]) for i in range(len(valid))] == [{"b"}] * len(valid)
    assert [_source_of(test[i]) for i in range(len(test))] == [{"c"}] * len(test)
    # Every document of a per-split dataset is used (no --split cut): the valid set reads all 40 documents.
    assert valid.document_range == (0, 40)


def test_per_split_json_and_data_args_file(prefixes, tmp_path):
    split_file = tmp_path / "splits.json"
    split_file.write_text(json.dumps({"train": [prefixes["a"]], "valid": f"1 {prefixes['b']}", "test": []}))
    args = _args(["--per-split-data-args-path", str(split_file)])
    assert (args.train_data_path, args.valid_data_path, args.test_data_path) == ([prefixes["a"]],
                                                                                ["1", prefixes["b"]], None)
    _, (train, valid, test) = _datasets(args)
    assert {"a"} == set.union(*(_source_of(train[i]) for i in range(len(train))))
    assert {"b"} == set.union(*(_source_of(valid[i]) for i in range(len(valid))))
    assert test is None

    data_file = tmp_path / "data_args.txt"
    data_file.write_text(f"0.5 {prefixes['c']}\n0.5 {prefixes['d']}\n")
    args = _args(["--data-args-path", str(data_file), "--split", "8,1,1"])
    assert args.data_path == ["0.5", prefixes["c"], "0.5", prefixes["d"]]
    config, (train, _, _) = _datasets(args)
    assert config.blend == ((prefixes["c"], prefixes["d"]), (0.5, 0.5))
    assert set.union(*(_source_of(train[i]) for i in range(len(train)))) == {"c", "d"}



def test_split_with_per_split_paths_is_refused_as_upstream(prefixes, tmp_path):
    # Upstream's --split defaults to None (969,30,1 filled in for --data-path only) and its config refuses
    # split together with per-split blends, which read all of their datasets' documents.
    split_file = tmp_path / "splits.json"
    split_file.write_text(json.dumps({"train": [prefixes["a"]]}))
    for flags in (["--train-data-path", prefixes["a"]], ["--per-split-data-args-path", str(split_file)]):
        with pytest.raises(ValueError, match=r"^--split 8,1,1 divides the --data-path datasets into train/valid/test; "
                                             r"with --train-data-path / .* drop --split"):
            _args(flags + ["--split", "8,1,1"])
        assert _args(flags).split is None and _datasets(_args(flags))[0].split is None
    assert _args(["--data-path", prefixes["a"]]).split == "969, 30, 1"


def test_no_mmap_and_builder_threads_read_the_same_samples(prefixes):
    flags = ["--data-path", "0.5", prefixes["a"], "0.5", prefixes["b"], "--split", "8,1,1"]
    _, mapped = _datasets(_args(flags))
    config, in_memory = _datasets(_args(flags + ["--no-mmap-bin-files", "--num-dataset-builder-threads", "3"]))
    assert config.mmap_bin_files is False and config.num_dataset_builder_threads == 3
    part = in_memory[0].datasets[0].indexed_dataset
    assert not part.mmap and not isinstance(part._tokens, np.memmap)
    for split in range(3):
        for index in range(len(mapped[split])):
            assert mapped[split][index]["tokens"].tolist() == in_memory[split][index]["tokens"].tolist()
    # A DataLoader worker reopens the dataset the same way.
    reopened = IndexedDataset.__new__(IndexedDataset)
    reopened.__setstate__(part.__getstate__())
    assert not reopened.mmap and reopened[3].tolist() == part[3].tolist()


def test_mid_level_dataset_surplus_sizes_the_blended_datasets(prefixes):
    flags = ["--data-path", "0.25", prefixes["a"], "0.75", prefixes["b"], "--split", "8,1,1"]
    config, (train, _, _) = _datasets(_args(flags + ["--mid-level-dataset-surplus", "0.1"]))
    assert config.mid_level_dataset_surplus == 0.1
    # 40 training samples: ceil(ceil(40 * 0.25) * 1.1) = 11 and ceil(ceil(40 * 0.75) * 1.1) = 33.
    assert [part.num_samples for part in train.datasets] == [11, 33]
    assert np.bincount(np.asarray(train.dataset_index)).tolist() == [10, 30]


def test_a_provider_ignoring_a_data_flag_fails_naming_it(prefixes):
    args = _args(["--data-path", prefixes["a"], "--no-mmap-bin-files", "--split", "8,1,1"])
    by_hand = GPTDatasetConfig(random_seed=1234, sequence_length=16, blend=([prefixes["a"]], None),
                               split="8,1,1", tokenizer=NullTokenizer(VOCAB_SIZE))
    datasets = build_gpt_datasets(by_hand, COUNTS)
    with pytest.raises(ValueError, match="without --no-mmap-bin-files.*gpt_dataset_config_from_args"):
        check_datasets_follow_flags(datasets, args)
    check_datasets_follow_flags(_datasets(args)[1], args)  # the helper's config passes
    per_split = _args(["--train-data-path", prefixes["a"]])
    with pytest.raises(ValueError, match="--train-data-path / --valid-data-path / --test-data-path"):
        check_datasets_follow_flags(datasets, per_split)


def test_no_shared_fs_builds_the_index_cache_on_each_node(monkeypatch):
    from megatron.core.datasets import gpt_dataset

    monkeypatch.setattr(gpt_dataset.torch.distributed, "get_rank", lambda: 5)  # rank 1 of the second node of 4
    monkeypatch.setenv("LOCAL_RANK", "1")
    shared = GPTDatasetConfig(random_seed=1, sequence_length=8, mock=True, tokenizer=NullTokenizer(VOCAB_SIZE))
    per_node = GPTDatasetConfig(random_seed=1, sequence_length=8, mock=True, tokenizer=NullTokenizer(VOCAB_SIZE),
                                shared_filesystem=False)
    assert not gpt_dataset._builds_index_cache(shared) and not gpt_dataset._builds_index_cache(per_node)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert not gpt_dataset._builds_index_cache(shared) and gpt_dataset._builds_index_cache(per_node)

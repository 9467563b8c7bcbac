"""`build_data_iterators`: external iterators passed through, blends too short for the run, where validation starts,
tensor-parallel ranks left without datasets by the provider."""

import argparse
import re

import numpy as np
import pytest

from megatron.training.data_iterators import build_data_iterators

ARGS = argparse.Namespace(dataloader_type="external", train_iters=4, global_batch_size=8, eval_interval=2,
                          eval_iters=1)


def test_external_iterators_pass_through():
    train, valid = iter(range(3)), iter("ab")
    requested = []

    def provider(counts):
        requested.append(counts)
        return train, valid, None

    assert build_data_iterators(provider, ARGS) == (train, valid, None)
    assert requested == [[32, 24, 8]]  # the sample counts a provider sizes its data by


def test_external_needs_iterators_not_datasets():
    with pytest.raises(TypeError, match="--dataloader-type external: the datasets provider returned a list for "
                                        "train; .*iter\\(your_loader\\)"):
        build_data_iterators(lambda counts: ([1, 2], None, None), ARGS)


class _Numbers:
    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return index


def test_a_single_pass_over_a_too_short_blend_stops_up_front():
    # Prefixes without weights blend one epoch of each dataset (as upstream): 10 samples cannot last 4 x 8.
    from megatron.core.datasets.blended_dataset import BlendedDataset

    blend = BlendedDataset([_Numbers(5), _Numbers(5)], [5, 5], 10)
    args = argparse.Namespace(**{**vars(ARGS), "dataloader_type": "single"})
    with pytest.raises(ValueError, match="the training blend holds 10 samples .* fewer than the 32 --train-iters"):
        build_data_iterators(lambda counts: (blend, None, None), args)


def _first_validation_batch(**overrides):
    args = argparse.Namespace(**{**vars(ARGS), "dataloader_type": "single", "micro_batch_size": 4,
                                 "global_batch_size": 4, "num_workers": 0, "seed": 0, "consumed_train_samples": 0,
                                 "train_iters": 10, "eval_interval": 5, "eval_iters": 2, **overrides})
    valid_samples = []

    def provider(counts):
        valid_samples.append(counts[1])
        return None, _Numbers(counts[1]), None

    _, valid, _ = build_data_iterators(provider, args)
    return valid_samples[0], next(valid).tolist()


def test_a_resumed_run_evaluates_after_the_samples_earlier_evaluations_took():
    # Iteration 5 of --eval-interval 5: one evaluation of 2 global batches of 4 samples was done.
    assert _first_validation_batch(iteration=5, skip_train=False) == (24, [8, 9, 10, 11])


@pytest.mark.parametrize("train_iters, iteration", [(10, 10), (1, 1000)])
def test_skip_train_evaluates_from_the_first_validation_sample(train_iters, iteration):
    # As upstream: --skip-train reads the validation split from its start, whatever iteration was loaded (a
    # checkpoint of iteration 1000 evaluated with --train-iters 1 sizes the split for one evaluation).
    valid_samples, batch = _first_validation_batch(iteration=iteration, skip_train=True, train_iters=train_iters)
    assert valid_samples == (train_iters // 5 + 1) * 2 * 4
    assert batch == [0, 1, 2, 3]


def _validation_batches(valid_size, iteration, count):
    args = argparse.Namespace(**{**vars(ARGS), "dataloader_type": "single", "micro_batch_size": 4,
                                 "global_batch_size": 4, "num_workers": 0, "seed": 0, "consumed_train_samples": 0,
                                 "train_iters": 20, "eval_interval": 5, "eval_iters": 1, "iteration": iteration})
    _, valid, _ = build_data_iterators(lambda counts: (None, _Numbers(valid_size), None), args)
    return [next(valid).tolist() for _ in range(count)]


@pytest.mark.parametrize("iteration", [5, 15])
def test_a_resumed_validation_stream_continues_the_uninterrupted_one(iteration):
    # 11 validation samples make passes of 8 (2 global batches of 4, the partial third left out); each evaluation
    # takes one batch. After iteration 15 the three evaluations took 12 samples, more than the set holds.
    uninterrupted = _validation_batches(11, 0, 8)
    evaluations_done = iteration // 5
    assert _validation_batches(11, iteration, 4) == uninterrupted[evaluations_done:evaluations_done + 4]
    assert uninterrupted[:3] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]


def test_a_validation_set_smaller_than_one_global_micro_batch_stops_up_front():
    with pytest.raises(ValueError, match="the validation set holds 3 samples, fewer than one micro-batch for every "
                                         "data-parallel rank \\(4 x 1\\)"):
        build_data_iterators(lambda counts: (None, _Numbers(3), None),
                             argparse.Namespace(**{**vars(ARGS), "dataloader_type": "single", "micro_batch_size": 4,
                                                   "num_workers": 0, "seed": 0, "consumed_train_samples": 0}))


def test_a_test_set_shorter_than_its_evaluation_is_read_again():
    # --eval-iters 2 of 4 samples need 8 test samples; a blend without weights may hold fewer (here 6: one pass of
    # the first 4, the partial rest left out), and the evaluation reads the set again rather than running out.
    args = argparse.Namespace(**{**vars(ARGS), "dataloader_type": "single", "micro_batch_size": 4,
                                 "global_batch_size": 4, "num_workers": 0, "seed": 0, "consumed_train_samples": 0,
                                 "eval_iters": 2})
    _, _, test = build_data_iterators(lambda counts: (None, None, _Numbers(6)), args)
    assert [next(test).tolist() for _ in range(2)] == [[0, 1, 2, 3], [0, 1, 2, 3]]


def _cyclic_training_batches(consumed_train_samples, count):
    args = argparse.Namespace(**{**vars(ARGS), "dataloader_type": "cyclic", "micro_batch_size": 2,
                                 "global_batch_size": 2, "num_workers": 0, "seed": 0,
                                 "consumed_train_samples": consumed_train_samples})
    train, _, _ = build_data_iterators(lambda counts: (_Numbers(7), None, None), args)
    return [next(train).tolist() for _ in range(count)]


def test_cyclic_training_runs_epoch_after_epoch_and_resumes_with_the_same_samples():
    # Epochs of 6 samples (3 batches of 2), each in a new order; the training iterator goes on past the epochs.
    uninterrupted = _cyclic_training_batches(0, 9)
    epochs = [sorted(sum(uninterrupted[start:start + 3], [])) for start in (0, 3, 6)]
    assert epochs == [list(range(6))] * 3 and uninterrupted[:3] != uninterrupted[3:6]
    assert _cyclic_training_batches(8, 5) == uninterrupted[4:]


def _write_out_of_vocabulary_documents(prefix, largest_id):
    """Documents `1 2 <largest_id> 3 EOD`: token ids a tokenizer of VOCAB_SIZE ids has no row for."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from tests.unit_tests.datasets.gpt_test_data import EOD

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(60):
        builder.add_document(np.array([1, 2, largest_id, 3, EOD]), [5])
    builder.finalize(prefix + ".idx")


def _gpt_iterators(prefixes, split="1,1,1"):
    """(train, valid, test) iterators over GPT datasets of `prefixes` for a run whose embedding has 128 rows."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, build_gpt_datasets
    from megatron.core.datasets.utils import blend_from_data_path
    from tests.unit_tests.datasets.gpt_test_data import EodOnlyTokenizer

    config = GPTDatasetConfig(random_seed=1, sequence_length=8, blend=blend_from_data_path(prefixes), split=split,
                              tokenizer=EodOnlyTokenizer(), create_attention_mask=False)
    args = argparse.Namespace(**{**vars(ARGS), "dataloader_type": "single", "micro_batch_size": 2,
                                 "global_batch_size": 2, "num_workers": 0, "seed": 0, "consumed_train_samples": 0,
                                 "padded_vocab_size": 128, "tokenizer_type": "NullTokenizer", "vocab_size": 99})
    return build_data_iterators(lambda counts: build_gpt_datasets(config, counts), args)


def test_token_ids_beyond_the_vocabulary_stop_the_first_batch_naming_the_dataset_and_flags(tmp_path):
    from tests.unit_tests.datasets.gpt_test_data import write_documents

    good, bad = str(tmp_path / "good_text_document"), str(tmp_path / "bad_text_document")
    write_documents(good, num_documents=60, seed=3)
    _write_out_of_vocabulary_documents(bad, largest_id=300)
    for iterator in _gpt_iterators(["1", good, "1", bad]):  # train, validation and test: a weighted blend
        with pytest.raises(ValueError) as error:
            next(iterator)
        message = str(error.value)
        assert re.search(rf"sample \d+ of the (train|valid|test) split read from dataset {re.escape(bad)} holds token "
                         rf"id 300 \(documents? \d+(, \d+)* of {re.escape(bad)}\.bin\), outside the model's "
                         r"vocabulary of 128 ids", message), message
        assert good not in message  # the blend's other dataset is within the vocabulary
        assert "this run's tokenizer: --tokenizer-type NullTokenizer --vocab-size 99)" in message
        assert "Check --tokenizer-type, --vocab-size and --tokenizer-model / --vocab-file" in message
        assert "the data must be preprocessed with the tokenizer the run trains with" in message


def test_token_ids_within_the_vocabulary_pass(tmp_path):
    from tests.unit_tests.datasets.gpt_test_data import write_documents

    prefix = str(tmp_path / "good_text_document")
    write_documents(prefix, num_documents=60, seed=3)
    _write_out_of_vocabulary_documents(str(tmp_path / "edge_text_document"), largest_id=127)  # the last row
    train, valid, test = _gpt_iterators([prefix, str(tmp_path / "edge_text_document")])
    for iterator in (train, valid, test):
        batches = [next(iterator) for _ in range(3)]
        assert max(int(batch["tokens"].max()) for batch in batches) == 127  # read, not refused



def _write_with_one_corrupt_document(prefix, corrupt_document, token_id, dtype=np.uint16):
    """60 documents of ids below the eod, `corrupt_document` holding `token_id` in its middle."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from tests.unit_tests.datasets.gpt_test_data import EOD

    rng = np.random.default_rng(4)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for document in range(60):
        body = rng.integers(0, EOD, size=12)
        if document == corrupt_document:
            body[6] = token_id
        builder.add_document(np.append(body, EOD), [13])
    builder.finalize(prefix + ".idx")


def test_a_corrupt_document_read_after_the_first_batch_stops_naming_it(tmp_path):
    prefix = str(tmp_path / "late_text_document")
    _write_with_one_corrupt_document(prefix, corrupt_document=47, token_id=300)
    train, _, _ = _gpt_iterators([prefix], split="1,0,0")
    next(train)  # the first batch holds no sample of document 47
    with pytest.raises(ValueError) as error:
        for _ in train:
            pass
    assert re.search(rf"sample \d+ of the train split read from dataset {re.escape(prefix)} holds token id 300 "
                     rf"\(document 47 of {re.escape(prefix)}\.bin\), outside the model's vocabulary of 128 ids",
                     str(error.value)), str(error.value)


def test_a_negative_token_id_stops_naming_its_document(tmp_path):
    prefix = str(tmp_path / "signed_text_document")
    _write_with_one_corrupt_document(prefix, corrupt_document=3, token_id=-7, dtype=np.int32)
    train, _, _ = _gpt_iterators([prefix], split="1,0,0")
    with pytest.raises(ValueError, match=rf"holds token id -7 \(document 3 of {re.escape(prefix)}\.bin\), outside "
                                         "the model's vocabulary of 128 ids"):
        for _ in train:
            pass


class _TokenSamples:
    """Samples of token ids 1, one of them (`bad_sample`) holding `token_id`: a dataset other than a GPTDataset."""

    def __init__(self, size, bad_sample, token_id):
        self.size, self.bad_sample, self.token_id = size, bad_sample, token_id

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        import torch

        tokens = torch.ones(4, dtype=torch.int64)
        if index == self.bad_sample:
            tokens[2] = self.token_id
        return {"tokens": tokens, "labels": tokens.roll(-1)}


def test_every_batch_of_any_dataset_is_checked_against_the_vocabulary():
    args = argparse.Namespace(**{**vars(ARGS), "dataloader_type": "single", "micro_batch_size": 2,
                                 "global_batch_size": 2, "num_workers": 0, "seed": 0, "consumed_train_samples": 0,
                                 "padded_vocab_size": 128, "tokenizer_type": "NullTokenizer", "vocab_size": 99})
    train, _, _ = build_data_iterators(lambda counts: (_TokenSamples(8, 5, 200), None, None), args)
    assert next(train)["tokens"].max() == 1 and next(train)["tokens"].max() == 1
    with pytest.raises(ValueError, match="a batch read from a _TokenSamples holds token id 200, outside the model's "
                                         r"vocabulary of 128 ids \(the padded vocabulary size of this run's tokenizer: "
                                         r"--tokenizer-type NullTokenizer --vocab-size 99\)"):
        next(train)


def _tensor_parallel_pair(monkeypatch, other_rank_built):
    """This process as tensor-parallel rank 1 of 2, whose rank 0 built the splits `other_rank_built` says
    (train, valid, test)."""
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_group", lambda: "tp group")

    def all_gather(per_rank, built, group=None):
        assert group == "tp group"
        per_rank[0].copy_(torch.tensor(other_rank_built, dtype=built.dtype))
        per_rank[1].copy_(built)

    monkeypatch.setattr(dist, "all_gather", all_gather)


def test_a_provider_building_on_tensor_parallel_rank_0_only_stops_naming_the_others(monkeypatch):
    # Upstream's is_dataset_built_on_rank (tensor-parallel rank 0 of the first and last stages) leaves rank 1 with
    # None: here every rank reads its own batches, so the run stops at start-up instead of at rank 1's first batch.
    _tensor_parallel_pair(monkeypatch, other_rank_built=[1, 1, 0])
    args = argparse.Namespace(**{**vars(ARGS), "dataloader_type": "single"})
    with pytest.raises(ValueError, match=r"built no train dataset on tensor-parallel rank\(s\) \[1\] of 2, while the "
                                         r"others have one\. .*BlendedMegatronDatasetBuilder\(cls, sizes, lambda: "
                                         r"True, config\)"):
        build_data_iterators(lambda counts: (None, None, None), args)


def test_splits_no_tensor_parallel_rank_has_pass(monkeypatch):
    # --split 0,1,0 (no train or test split anywhere), or a middle pipeline stage without any data.
    _tensor_parallel_pair(monkeypatch, other_rank_built=[0, 0, 0])
    args = argparse.Namespace(**{**vars(ARGS), "dataloader_type": "single", "micro_batch_size": 4, "num_workers": 0,
                                 "seed": 0, "consumed_train_samples": 0})
    assert build_data_iterators(lambda counts: (None, None, None), args) == (None, None, None)
    _tensor_parallel_pair(monkeypatch, other_rank_built=[0, 1, 0])
    train, valid, test = build_data_iterators(lambda counts: (None, _Numbers(8), None), args)
    monkeypatch.undo()  # reading needs no process group
    assert (train, test) == (None, None) and next(valid).tolist() == [0, 1, 2, 3]


def test_upstreams_iterator_builder_reads_the_parsed_arguments_and_resumes_after_the_loaded_iteration(monkeypatch):
    from megatron.training import global_state
    from megatron.training.data_iterators import (
        build_train_valid_test_data_iterators,
        cyclic_iter,
        get_train_valid_test_num_samples,
    )

    args = argparse.Namespace(**{**vars(ARGS), "dataloader_type": "single", "micro_batch_size": 2,
                                 "global_batch_size": 2, "num_workers": 0, "seed": 0, "iteration": 3})
    monkeypatch.setattr(global_state, "get_args", lambda: args)
    assert get_train_valid_test_num_samples() == [8, 6, 2]
    requested = []

    def provider(counts):
        requested.append(counts)
        return _Numbers(counts[0]), None, None

    train, valid, test = build_train_valid_test_data_iterators(provider)
    assert requested == [[8, 6, 2]] and args.consumed_train_samples == 6 and valid is None and test is None
    assert [batch.tolist() for batch in train] == [[6, 7]]
    assert [next(stream) for stream in [cyclic_iter([1, 2])] for _ in range(5)] == [1, 2, 1, 2, 1]

import itertools

import pytest
import torch

from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import Split
from megatron.training.datasets.data_samplers import MegatronPretrainingSampler, build_pretraining_data_loader
from megatron.training.tokenizer import NullTokenizer


def _all_rank_batches(total, consumed, micro_batch_size, data_parallel_size, drop_last=True):
    return [
        list(MegatronPretrainingSampler(total, consumed, micro_batch_size, rank, data_parallel_size, drop_last))
        for rank in range(data_parallel_size)
    ]


@pytest.mark.parametrize(
    "total,consumed,micro_batch_size,data_parallel_size", [(50, 0, 2, 3), (64, 16, 4, 2), (9, 0, 1, 1)]
)
def test_ranks_read_contiguous_slices_of_each_global_micro_batch(total, consumed, micro_batch_size, data_parallel_size):
    per_rank = _all_rank_batches(total, consumed, micro_batch_size, data_parallel_size)
    global_size = micro_batch_size * data_parallel_size
    steps = (total - consumed) // global_size
    assert all(len(batches) == steps for batches in per_rank)
    for step in range(steps):
        start = consumed + step * global_size
        for rank in range(data_parallel_size):
            first = start + rank * micro_batch_size
            assert per_rank[rank][step] == list(range(first, first + micro_batch_size))
    # Together the ranks cover every full global batch exactly once.
    covered = sorted(index for batches in per_rank for batch in batches for index in batch)
    assert covered == list(range(consumed, consumed + steps * global_size))


def test_resume_continues_where_the_run_stopped():
    full = _all_rank_batches(100, 0, 2, 2)
    resumed = _all_rank_batches(100, 40, 2, 2)
    assert [batches[10:] for batches in full] == resumed


def test_last_partial_batch_kept_when_asked():
    per_rank = _all_rank_batches(11, 0, 2, 2, drop_last=False)
    assert per_rank[0][-1] == [8, 9] and per_rank[1][-1] == [10]


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError, match="consumed_samples"):
        MegatronPretrainingSampler(10, 10, 1, 0, 1)
    with pytest.raises(ValueError, match="rank 2"):
        MegatronPretrainingSampler(10, 0, 1, 2, 2)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_data_loader_yields_batch_dicts(num_workers):
    config = GPTDatasetConfig(random_seed=3, sequence_length=8, mock=True, tokenizer=NullTokenizer(32),
                              create_attention_mask=False)
    dataset = MockGPTDataset(None, None, None, 24, Split.train, config)
    loader = build_pretraining_data_loader(dataset, 4, micro_batch_size=2, data_parallel_rank=1,
                                           data_parallel_size=2, num_workers=num_workers)
    batches = list(loader)
    assert len(batches) == 5
    first = batches[0]
    assert set(first) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert first["tokens"].shape == (2, 8) and first["tokens"].dtype == torch.int64
    assert first["loss_mask"].dtype == torch.float32 and first["position_ids"].shape == (2, 8)
    # Rank 1 of 2 after 4 consumed samples reads samples 6 and 7 first.
    expected = torch.stack([dataset[6]["tokens"], dataset[7]["tokens"]])
    torch.testing.assert_close(first["tokens"], expected, rtol=0, atol=0)
    assert build_pretraining_data_loader(None, 0, 2, 0, 1) is None


def _cyclic_batches(total, consumed, micro_batch_size, data_parallel_size, steps, data_sharding=True):
    from megatron.training.datasets.data_samplers import MegatronPretrainingRandomSampler

    per_rank = []
    for rank in range(data_parallel_size):
        sampler = MegatronPretrainingRandomSampler(None, total, consumed, micro_batch_size, rank, data_parallel_size,
                                                   data_sharding)
        iterator = itertools.chain.from_iterable(iter(sampler) for _ in itertools.count())  # pass after pass
        per_rank.append([next(iterator) for _ in range(steps)])
    return per_rank


@pytest.mark.parametrize("data_sharding", [True, False])
def test_cyclic_sampler_reshuffles_every_epoch_and_resumes_exactly(data_sharding):
    # 22 samples, global micro-batch 2 x 2: epochs of 20 samples (5 steps), each a new order, without end.
    per_rank = _cyclic_batches(22, 0, 2, 2, steps=15, data_sharding=data_sharding)
    epochs = [[index for step in range(epoch * 5, epoch * 5 + 5) for batches in per_rank for index in batches[step]]
              for epoch in range(3)]
    assert all(len(set(epoch)) == 20 and set(epoch) <= set(range(22)) for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(20))
    # Resuming mid-epoch (28 samples consumed: epoch 1, step 2) continues with the very same batches.
    resumed = _cyclic_batches(22, 28, 2, 2, steps=8, data_sharding=data_sharding)
    assert [batches[7:] for batches in per_rank] == resumed


def test_dataloader_type_cyclic_reaches_the_loader():
    config = GPTDatasetConfig(random_seed=5, sequence_length=8, mock=True, tokenizer=NullTokenizer(50))
    dataset = MockGPTDataset(None, None, None, 8, Split.train, config)
    single = build_pretraining_data_loader(dataset, 0, 2, 0, 1)
    cyclic = build_pretraining_data_loader(dataset, 0, 2, 0, 1, dataloader_type="cyclic", seed=3)
    single_batches = [batch["tokens"] for batch in single]
    cyclic_batches = [batch["tokens"] for _ in range(2) for batch in itertools.islice(cyclic, 10)]  # 2 epochs
    assert len(single_batches) == 4 and len(cyclic_batches) == 8
    as_rows = lambda batches: sorted(map(tuple, torch.cat(batches).tolist()))  # noqa: E731
    assert as_rows(cyclic_batches[:4]) == as_rows(single_batches) == as_rows(cyclic_batches[4:])
    assert not all(torch.equal(a, b) for a, b in zip(cyclic_batches[:4], single_batches))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_iterating_the_loader_leaves_the_global_generator_alone(num_workers):
    # Dropout draws from torch's global generator on the CPU: starting or restarting a loader's iterator (the
    # training iterator after a checkpoint load, the validation iterator every epoch) must not advance it.
    config = GPTDatasetConfig(random_seed=3, sequence_length=8, mock=True, tokenizer=NullTokenizer(32))
    dataset = MockGPTDataset(None, None, None, 8, Split.train, config)
    loader = build_pretraining_data_loader(dataset, 0, 2, 0, 1, num_workers=num_workers, seed=11)
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    first_pass = [batch["tokens"] for batch in loader]
    second_pass = [batch["tokens"] for batch in loader]
    torch.testing.assert_close(torch.rand(4), expected, rtol=0, atol=0)
    assert len(first_pass) == 4 and all(torch.equal(a, b) for a, b in zip(first_pass, second_pass))


def test_workers_outlive_the_signal_the_rank_catches():
    """Launchers send SIGTERM to every process of the job; with --exit-signal-handler the rank catches it to save a
    checkpoint, so its loader's workers must not die of it (torch's workers do, by default)."""
    import os
    import signal

    config = GPTDatasetConfig(random_seed=3, sequence_length=8, mock=True, tokenizer=NullTokenizer(32))
    dataset = MockGPTDataset(None, None, None, 8, Split.train, config)
    expected = [batch["tokens"] for batch in build_pretraining_data_loader(dataset, 0, 2, 0, 1)]
    loader = build_pretraining_data_loader(dataset, 0, 2, 0, 1, num_workers=1, worker_ignored_signal=signal.SIGTERM)
    iterator = iter(loader)
    batches = [next(iterator)["tokens"]]
    os.kill(iterator._workers[0].pid, signal.SIGTERM)
    batches += [batch["tokens"] for batch in iterator]
    assert len(batches) == len(expected) and all(torch.equal(a, b) for a, b in zip(batches, expected))


def _mock_dataset(num_samples, split=Split.train):
    config = GPTDatasetConfig(random_seed=5, sequence_length=8, mock=True, tokenizer=NullTokenizer(50),
                              create_attention_mask=False)
    return MockGPTDataset(None, None, None, num_samples, split, config)


def test_a_pass_over_a_cyclic_loader_is_one_epoch_and_the_next_pass_the_next_epoch():
    # As upstream's sampler: `for batch in loader` ends with the epoch (the training iterator chains the passes).
    dataset = _mock_dataset(9)  # epochs of 8 samples: 4 micro-batches of 2
    loader = build_pretraining_data_loader(dataset, 4, 2, 0, 1, dataloader_type="cyclic")
    first = [batch["tokens"] for batch in itertools.islice(loader, 10)]
    assert len(first) == 2 and loader.batch_sampler.consumed_samples == 8  # the rest of epoch 0
    second = [batch["tokens"] for batch in itertools.islice(loader, 10)]
    assert len(second) == 4 and loader.batch_sampler.consumed_samples == 16
    fresh = build_pretraining_data_loader(dataset, 8, 2, 0, 1, dataloader_type="cyclic")
    assert all(torch.equal(a, b["tokens"]) for a, b in zip(second, fresh, strict=True))


@pytest.mark.parametrize("dataloader_type", ["single", "cyclic"])
def test_upstreams_two_argument_form_reads_the_parsed_arguments(monkeypatch, dataloader_type):
    import argparse

    from megatron.training import global_state

    args = argparse.Namespace(micro_batch_size=3, num_workers=0, dataloader_type=dataloader_type, seed=1,
                              data_sharding=True, full_validation=False)
    monkeypatch.setattr(global_state, "get_args", lambda: args)
    dataset = _mock_dataset(12)
    loader = build_pretraining_data_loader(dataset, 6)
    expected = build_pretraining_data_loader(dataset, 6, 3, 0, 1, dataloader_type=dataloader_type)
    batches = [batch["tokens"] for batch in loader]
    assert [tuple(batch.shape) for batch in batches] == [(3, 8), (3, 8)]
    assert all(torch.equal(a, b["tokens"]) for a, b in zip(batches, expected, strict=True))


def test_upstreams_two_argument_form_reads_a_full_validation_split_from_its_start(monkeypatch):
    import argparse

    from megatron.training import global_state

    args = argparse.Namespace(micro_batch_size=2, num_workers=0, dataloader_type="single", seed=1,
                              data_sharding=True, full_validation=True)
    monkeypatch.setattr(global_state, "get_args", lambda: args)
    assert len(list(build_pretraining_data_loader(_mock_dataset(8, Split.valid), 4))) == 4
    assert len(list(build_pretraining_data_loader(_mock_dataset(8, Split.train), 4))) == 2


def test_external_hands_the_dataset_back_as_upstream():
    dataset = _mock_dataset(4)
    assert build_pretraining_data_loader(dataset, 0, 2, 0, 1, dataloader_type="external") is dataset


def test_a_partial_layout_names_what_is_missing():
    with pytest.raises(TypeError, match="micro_batch_size needs data_parallel_rank and data_parallel_size"):
        build_pretraining_data_loader(_mock_dataset(4), 0, 2)

"""The data a run reads, sample for sample, against an independent statement of Megatron-Core's algorithm.

`_Upstream*` below restate upstream's documented pipeline from scratch (split matrix, per-epoch document shuffles
with the separate final epoch, sample boundaries walked document by document, shuffle index, blend sizes and the
greedy blending schedule, and the single / cyclic batch samplers); the tests compare what every data-parallel
rank reads at every step with what they say.
"""

import math
import re

import numpy as np
import pytest
import torch

from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, build_gpt_datasets
from megatron.core.datasets.utils import blend_from_data_path
from megatron.training.datasets.data_samplers import build_pretraining_data_loader
from megatron.training.validation_sets import endless
from tests.unit_tests.datasets.gpt_test_data import EodOnlyTokenizer, write_documents

SEQ = 13
SEED = 1234


def _normalised(values):
    values = np.array(values, dtype=np.float64)
    return (values / np.sum(values)).tolist()


def _upstream_split_ranges(split, num_sequences):
    """[(begin, end) or None] for train, valid, test: the split matrix applied to the sequence count."""
    numbers = [float(text) for text in re.findall(r"[.0-9]+", split)]
    fractions = _normalised(numbers + [0.0] * (3 - len(numbers)))
    edges = [0.0]
    for fraction in fractions:
        edges.append(edges[-1] + fraction)
    return [None if high <= low else (int(round(low * num_sequences)), int(round(high * num_sequences)))
            for low, high in zip(edges[:-1], edges[1:])]


class _UpstreamGPT:
    """The packed samples of documents [begin, end) for `num_samples` (None: one epoch)."""

    def __init__(self, documents, begin, end, num_samples):
        self.documents = documents
        sizes = np.array([len(document) for document in documents])
        chosen = np.arange(begin, end)
        per_epoch = int(sizes[chosen].sum())
        epochs = 1
        while num_samples is not None and epochs * per_epoch < num_samples * SEQ + 1:
            epochs += 1
        separate = False
        if epochs > 1:
            before_last = ((epochs - 1) * per_epoch - 1) // SEQ
            separate = num_samples - before_last < int(0.8 * ((per_epoch - 1) // SEQ))
        random_state = np.random.RandomState(SEED)

        def shuffled_epochs(count):
            order = np.tile(chosen, count)
            random_state.shuffle(order)
            return order

        self.order = (np.concatenate([shuffled_epochs(epochs - 1), shuffled_epochs(1)]) if separate
                      else shuffled_epochs(epochs))
        total = (epochs * per_epoch - 1) // SEQ
        # Where each sample starts: walk the documents, SEQ + 1 tokens a sample, the last one shared.
        self.starts = [(0, 0)]
        position, offset = 0, 0
        for _ in range(total):
            wanted = SEQ + 1
            while wanted > sizes[self.order[position]] - offset:
                wanted -= sizes[self.order[position]] - offset
                position, offset = position + 1, 0
            offset += wanted - 1
            self.starts.append((position, offset))

        def shuffled_range(low, high):
            values = np.arange(low, high)
            random_state.shuffle(values)
            return values

        self.shuffle = (np.concatenate([shuffled_range(0, before_last), shuffled_range(before_last, total)])
                        if separate else shuffled_range(0, total))

    def __len__(self):
        return len(self.shuffle)

    def window(self, index):
        (first, first_offset), (last, last_offset) = self.starts[self.shuffle[index]: self.shuffle[index] + 2]
        stream = np.concatenate([self.documents[self.order[position]] for position in range(first, last + 1)])
        assert len(stream) - len(self.documents[self.order[last]]) + last_offset == first_offset + SEQ
        return stream[first_offset: first_offset + SEQ + 1]


class _UpstreamBlend:
    def __init__(self, parts, weights, size):
        self.parts = parts
        shares = _normalised(weights)
        taken = [0] * len(parts)
        self.schedule = []
        for index in range(size):
            scale = float(max(index, 1))
            best = 0
            for candidate in range(1, len(parts)):
                if shares[candidate] * scale - taken[candidate] > shares[best] * scale - taken[best]:
                    best = candidate
            self.schedule.append((best, taken[best]))
            taken[best] += 1

    def __len__(self):
        return len(self.schedule)

    def window(self, index):
        part, position = self.schedule[index]
        return self.parts[part].window(position)


def _upstream_splits(corpora, weights, split, sizes, surplus=0.005):
    """What upstream's builder makes of `--data-path` (weights None: prefixes only) for `sizes` samples."""
    ranges = [_upstream_split_ranges(split, len(documents)) for documents in corpora]
    if len(corpora) == 1 and weights is None:
        return [None if ranges[0][i] is None else _UpstreamGPT(corpora[0], *ranges[0][i], sizes[i]) for i in range(3)]
    shares = None if weights is None else _normalised(weights)
    splits = []
    for i in range(3):
        if ranges[0][i] is None:
            splits.append(None)
            continue
        if shares is None:
            parts = [_UpstreamGPT(documents, *dataset_ranges[i], None)
                     for documents, dataset_ranges in zip(corpora, ranges)]
            lengths = [len(part) for part in parts]
            splits.append(_UpstreamBlend(parts, lengths, min(sizes[i], sum(lengths))))
        else:
            targets = [math.ceil(sizes[i] * share) for share in shares]
            parts = [_UpstreamGPT(documents, *dataset_ranges[i], math.ceil(target * (1 + surplus)))
                     for documents, dataset_ranges, target in zip(corpora, ranges, targets)]
            splits.append(_UpstreamBlend(parts, shares, sum(targets)))
    return splits


def _upstream_single_batches(total, consumed, micro_batch, rank, ranks):
    for start in range(consumed, total - micro_batch * ranks + 1, micro_batch * ranks):
        yield list(range(start + rank * micro_batch, start + (rank + 1) * micro_batch))


def _upstream_cyclic_batches(total, consumed, micro_batch, rank, ranks, sharding):
    """Upstream's random sampler, iterated again each time a pass ends (its `cyclic_iter`)."""
    per_epoch = total - total % (micro_batch * ranks)
    while True:
        epoch, done = consumed // per_epoch, consumed % per_epoch
        generator = torch.Generator()
        generator.manual_seed(epoch)
        if sharding:
            bucket = total // (micro_batch * ranks) * micro_batch
            entries = [rank * bucket + i for i in torch.randperm(bucket, generator=generator).tolist()[done // ranks:]]
        else:
            entries = torch.randperm(total // micro_batch * micro_batch, generator=generator).tolist()[done:]
            entries = entries[rank::ranks]
        for start in range(0, len(entries) // micro_batch * micro_batch, micro_batch):
            consumed += micro_batch * ranks
            yield entries[start: start + micro_batch]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Three datasets of odd sizes; documents of 1 to 31 tokens, every one ending with the eod."""
    directory = tmp_path_factory.mktemp("upstream_order")
    prefixes, documents = [], []
    for name, count, seed in (("a", 37, 1), ("b", 23, 2), ("c", 51, 3)):
        prefixes.append(str(directory / name))
        documents.append(write_documents(prefixes[-1], count, seed=seed, min_length=0, max_length=30))
    return prefixes, documents


# 12 iterations of global batch 12, an evaluation every 5 of 2 iterations: upstream's split sample counts.
TRAIN_ITERS, GLOBAL_BATCH, EVAL_INTERVAL, EVAL_ITERS, MICRO_BATCH = 12, 12, 5, 2, 2
COUNTS = [TRAIN_ITERS * GLOBAL_BATCH, (TRAIN_ITERS // EVAL_INTERVAL + 1) * EVAL_ITERS * GLOBAL_BATCH,
          EVAL_ITERS * GLOBAL_BATCH]


def _compare(ours, upstream, ranks, dataloader_type, consumed, steps, sharding=True):
    assert len(ours) == len(upstream)
    for rank in range(ranks):
        loader = build_pretraining_data_loader(ours, consumed, MICRO_BATCH, rank, ranks,
                                               dataloader_type=dataloader_type, data_sharding=sharding)
        if dataloader_type == "single":
            expected = _upstream_single_batches(len(upstream), consumed, MICRO_BATCH, rank, ranks)
        else:
            expected = _upstream_cyclic_batches(len(upstream), consumed, MICRO_BATCH, rank, ranks, sharding)
        if dataloader_type == "cyclic":
            loader = endless(loader)  # each pass over a cyclic loader is one epoch, as upstream's
        served = 0
        for batch, indices in zip(loader, expected):
            windows = np.stack([upstream.window(index) for index in indices])
            np.testing.assert_array_equal(batch["tokens"].numpy(), windows[:, :-1])
            np.testing.assert_array_equal(batch["labels"].numpy(), windows[:, 1:])
            served += 1
            if served == steps:
                break
        assert served == steps


@pytest.mark.parametrize("data_path,ranks,dataloader_type,consumed", [
    (["0.5", "a", "0.3", "b", "0.2", "c"], 2, "single", 0),
    (["0.5", "a", "0.3", "b", "0.2", "c"], 3, "single", 24),
    (["0.5", "a", "0.3", "b", "0.2", "c"], 3, "cyclic", 0),
    (["1.0", "c"], 2, "single", 0),  # one weighted prefix is a blend of one dataset, built with the surplus
    (["1.0", "c"], 2, "cyclic", 48),
    (["a", "b", "c"], 2, "cyclic", 12),  # without weights: one epoch of each, blended by size
    (["a"], 3, "cyclic", 0),
    (["c"], 2, "single", 0),
])
def test_every_split_serves_upstreams_samples_in_upstreams_order(corpora, data_path, ranks, dataloader_type,
                                                                  consumed):
    prefixes, documents = corpora
    names = dict(zip("abc", prefixes))
    resolved = [names.get(word, word) for word in data_path]
    weights = [float(word) for word in data_path[0::2]] if data_path[0] not in names else None
    chosen = [documents["abc".index(word)] for word in data_path if word in names]
    config = GPTDatasetConfig(random_seed=SEED, sequence_length=SEQ, blend=blend_from_data_path(resolved),
                              split="85,10,5", tokenizer=EodOnlyTokenizer(), create_attention_mask=False)
    counts = list(COUNTS)
    if weights is None and len(chosen) > 1:
        counts[0] = 60  # within one epoch of each dataset, where upstream's blend has that many samples
    ours = build_gpt_datasets(config, counts)
    upstream = _upstream_splits(chosen, weights, "85,10,5", counts)
    for split, (mine, theirs) in enumerate(zip(ours, upstream)):
        steps = (counts[split] - consumed) // (MICRO_BATCH * ranks) if dataloader_type == "single" else \
            2 * len(theirs) // (MICRO_BATCH * ranks) + 1  # past the end of the second epoch
        _compare(mine, theirs, ranks, dataloader_type, consumed, steps)


@pytest.mark.parametrize("ranks,consumed", [(2, 0), (3, 18), (2, 52)])
def test_cyclic_without_data_sharding_follows_upstream(corpora, ranks, consumed):
    prefixes, documents = corpora
    config = GPTDatasetConfig(random_seed=SEED, sequence_length=SEQ, blend=blend_from_data_path([prefixes[1]]),
                              split="1", tokenizer=EodOnlyTokenizer(), create_attention_mask=False)
    train, _, _ = build_gpt_datasets(config, (30, 0, 0))
    upstream = _upstream_splits([documents[1]], None, "1", (30, 0, 0))[0]
    _compare(train, upstream, ranks, "cyclic", consumed, 2 * len(upstream) // (MICRO_BATCH * ranks) + 1,
             sharding=False)


def test_split_ranges_follow_upstreams_matrix():
    from megatron.core.datasets.utils import parse_split, split_document_ranges

    for split, count in (("969,30,1", 1000), ("99,1", 37), ("100", 23), ("85,10,5", 51), ("98/2/0", 7)):
        expected = [bounds or (0, 0) for bounds in _upstream_split_ranges(split, count)]
        ours = split_document_ranges(count, parse_split(split))
        assert [bounds for bounds, wanted in zip(ours, expected) if wanted != (0, 0)] == \
            [bounds for bounds in expected if bounds != (0, 0)]


def _train_split(prefixes, words, count):
    names = dict(zip("abc", prefixes))
    config = GPTDatasetConfig(random_seed=SEED, sequence_length=SEQ, split="85,10,5", tokenizer=EodOnlyTokenizer(),
                              blend=blend_from_data_path([names.get(word, word) for word in words]),
                              create_attention_mask=False)
    return build_gpt_datasets(config, (count, 0, 0))[0]


def test_blend_schedule_uses_upstreams_shares_to_the_last_bit(corpora):
    # 0.7 / 0.2 / 0.1 normalised twice (upstream) and three times differ in the last bit, which moves sample 6.
    prefixes, documents = corpora
    train = _train_split(prefixes, ["0.7", "a", "0.2", "b", "0.1", "c"], 60)
    upstream = _upstream_splits(documents, [0.7, 0.2, 0.1], "85,10,5", (60, 0, 0))[0]
    assert np.asarray(train.dataset_index[:60]).tolist() == [part for part, _ in upstream.schedule[:60]]


def test_one_weighted_prefix_is_built_with_the_surplus(corpora):
    # Exactly one epoch of c's training documents: upstream builds ceil(samples x 1.005), a second epoch.
    prefixes, documents = corpora
    begin, end = _upstream_split_ranges("85,10,5", len(documents[2]))[0]
    one_epoch = (sum(len(document) for document in documents[2][begin:end]) - 1) // SEQ
    train = _train_split(prefixes, ["1.0", "c"], one_epoch)
    upstream = _upstream_splits([documents[2]], [1.0], "85,10,5", (one_epoch, 0, 0))[0]
    for index in range(one_epoch):
        np.testing.assert_array_equal(train[index]["tokens"].numpy(), upstream.window(index)[:-1])

"""Supervised fine-tuning data (`pretrain_gpt.py --sft`): chat conversations from JSON-lines files, tokenized with a
chat prompt format, the loss on the assistant's replies only.

Each line of a file is one conversation, `{"messages": [{"role": "system" | "user" | "assistant", "content": ...},
...]}` (upstream's SFT layout). A conversation becomes `n` ids (megatron/training/tokenizer/chat_prompt_formats.py)
and so `n - 1` (input, label) positions, cut to `--seq-length + 1` ids when longer; a conversation with no trained
position is dropped. Every epoch visits a split's conversations in a new seeded order.

Two layouts of a sample (`--seq-length` positions):
- packed (the default): consecutive conversations of that order share a row, each running as if alone (upstream's
  THD layout: `cu_seqlens`, `cu_seqlens_padded`; megatron/training/packed_batch.py). Each conversation's span is
  rounded up to a multiple of `pad_multiple` (2 x CP under context parallelism) and the last span runs to the end
  of the row; a conversation that does not fit starts the next row. A sample is then a whole micro-batch.
- one conversation per sample (`pack=False`), padded to `--seq-length`; any micro-batch size.
Padding is out of the loss, and so is every position whose label is not trained.
"""

import dataclasses
import json
import math
import os

import numpy as np
import torch

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.utils import Split, normalize_weights, sample_position, split_document_ranges
from megatron.training.tokenizer.chat_prompt_formats import (
    DEFAULT_PROMPT_FORMAT,
    IGNORE_INDEX,
    prompt_format,
    tokenize_conversation,
)


@dataclasses.dataclass(frozen=True)
class SFTDatasetConfig:
    """What the SFT datasets are built from. `blend` is (paths, weights or None) split by `split` (three fractions);
    `blend_per_split` gives each split its own (paths, weights), or None for a split without data."""

    random_seed: int
    sequence_length: int
    tokenizer: object
    blend: tuple = None
    blend_per_split: tuple = None
    split: tuple = (1.0, 0.0, 0.0)
    prompt_format: str = DEFAULT_PROMPT_FORMAT
    pack: bool = True
    pad_multiple: int = 1
    multiple_validation_sets: bool = False

    def __post_init__(self):
        if (self.blend is None) == (self.blend_per_split is None):
            raise ValueError("--sft needs its conversations one way: --data-path FILE.jsonl [...] (with --split), or "
                             "--train-data-path / --valid-data-path / --test-data-path")
        if self.sequence_length < 1 or self.pad_multiple < 1:
            raise ValueError(f"SFTDatasetConfig: sequence_length ({self.sequence_length}) and pad_multiple "
                             f"({self.pad_multiple}) must be positive")
        if self.pack and self.sequence_length % self.pad_multiple:
            raise ValueError(f"--seq-length {self.sequence_length} must be a multiple of {self.pad_multiple} (2 x "
                             "--context-parallel-size) for packed SFT rows")
        prompt_format(self.prompt_format)  # names the flag when unknown


def check_conversation_files(paths):
    """Raise naming the flag when a JSON-lines file of conversations does not exist."""
    missing = [path for path in paths if not os.path.isfile(path)]
    if missing:
        raise FileNotFoundError(f"--sft reads conversations from JSON-lines files; {', '.join(missing)} "
                                f"{'does' if len(missing) == 1 else 'do'} not exist (--data-path / --train-data-path "
                                "give the .jsonl paths)")


class SFTLowLevelDataset:
    """The conversations of one JSON-lines file (upstream's name), each a list of messages."""

    def __init__(self, dataset_path):
        check_conversation_files([dataset_path])
        self.dataset_path = dataset_path
        self.conversations = []
        with open(dataset_path, encoding="utf-8") as stream:
            for line_number, line in enumerate(stream, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{dataset_path}:{line_number}: not JSON ({error.msg}); --sft reads one "
                                     "conversation per line") from None
                if not isinstance(record, dict) or "messages" not in record:
                    raise ValueError(f"{dataset_path}:{line_number}: a conversation is {{\"messages\": [{{\"role\": "
                                     "..., \"content\": ...}, ...]}")
                self.conversations.append((line_number, record["messages"]))

    def __len__(self):
        return len(self.conversations)

    def __getitem__(self, idx):
        return self.conversations[idx][1]


def _epoch_order(num_items, seed, epoch, split):
    return np.random.default_rng([seed, split.value, epoch]).permutation(num_items)


class SFTDataset(torch.utils.data.Dataset):
    """`num_samples` samples (packed rows or single conversations) from the conversations `indices` of `dataset`
    (an SFTLowLevelDataset), epoch after epoch; `num_samples` None serves one epoch (--full-validation)."""

    def __init__(self, dataset, dataset_path, indices, num_samples, index_split, config):
        self.dataset, self.dataset_path, self.split, self.config = dataset, dataset_path, index_split, config
        self.conversations = self._tokenized(dataset, indices, config)
        if not self.conversations:
            raise ValueError(f"the {index_split.name} split of {dataset_path} has no conversation with an assistant "
                             "reply to train on: add conversations or adjust --split")
        self.rows_by_epoch = []  # packed: each epoch's rows, lists of positions in self.conversations
        self._order = None  # one per sample: (epoch, that epoch's order of the conversations)
        epoch_size = len(self._rows_of_epoch(0)) if config.pack else len(self.conversations)
        self.num_samples = epoch_size if num_samples is None else int(num_samples)

    @staticmethod
    def _tokenized(dataset, indices, config):
        kept = []
        limit = config.sequence_length + 1
        for index in indices:
            line_number = dataset.conversations[int(index)][0] if hasattr(dataset, "conversations") else int(index)
            where = f"{getattr(dataset, 'dataset_path', 'conversation')}:{line_number}"
            try:
                tokens, target = tokenize_conversation(config.tokenizer, dataset[int(index)], config.prompt_format)
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
            tokens, target = np.asarray(tokens[:limit], dtype=np.int64), np.asarray(target[:limit], dtype=np.int64)
            if len(tokens) >= 2 and (target[1:] != IGNORE_INDEX).any():
                kept.append((tokens, target))
        return kept

    def __len__(self):
        return self.num_samples

    def _span(self, conversation):
        positions = len(conversation[0]) - 1
        return math.ceil(positions / self.config.pad_multiple) * self.config.pad_multiple

    def _rows_of_epoch(self, epoch):
        while len(self.rows_by_epoch) <= epoch:
            order = _epoch_order(len(self.conversations), self.config.random_seed, len(self.rows_by_epoch), self.split)
            rows, row, used = [], [], 0
            for position in order.tolist():
                span = self._span(self.conversations[position])
                if row and used + span > self.config.sequence_length:
                    rows.append(row)
                    row, used = [], 0
                row.append(position)
                used += span
            rows.append(row)
            self.rows_by_epoch.append(rows)
        return self.rows_by_epoch[epoch]

    def conversations_of_sample(self, idx):
        """Positions (in this split's kept conversations) of the conversations sample `idx` holds, in row order."""
        idx = sample_position(idx, self.num_samples, f"the {self.split.name} SFT dataset")
        if not self.config.pack:
            epoch, offset = divmod(idx, len(self.conversations))
            if self._order is None or self._order[0] != epoch:  # samples are read epoch after epoch: keep one order
                self._order = (epoch, _epoch_order(len(self.conversations), self.config.random_seed, epoch,
                                                   self.split))
            return [int(self._order[1][offset])]
        epoch = 0
        while idx >= len(self._rows_of_epoch(epoch)):
            idx -= len(self._rows_of_epoch(epoch))
            epoch += 1
        return self._rows_of_epoch(epoch)[idx]

    def __getitem__(self, idx):
        sequence_length, pad = self.config.sequence_length, self.config.tokenizer.pad
        tokens = torch.full((sequence_length,), pad, dtype=torch.int64)
        labels = torch.full((sequence_length,), pad, dtype=torch.int64)
        loss_mask = torch.zeros(sequence_length, dtype=torch.float32)
        position_ids = torch.zeros(sequence_length, dtype=torch.int64)
        members = self.conversations_of_sample(idx)
        starts, lengths, start = [], [], 0
        for member in members:
            ids, target = (torch.from_numpy(array) for array in self.conversations[member])
            length = len(ids) - 1
            span = self._span(self.conversations[member]) if self.config.pack else sequence_length
            tokens[start:start + length] = ids[:-1]
            labels[start:start + length] = ids[1:]
            loss_mask[start:start + length] = (target[1:] != IGNORE_INDEX).float()
            starts.append(start)
            lengths.append(length)
            start += span
        # Positions restart in each span; the last one runs to the row's end (its padding included).
        for begin, end in zip(starts, starts[1:] + [sequence_length]):
            position_ids[begin:end] = torch.arange(end - begin)
        sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
        if self.config.pack:
            sample.update(self._offsets(starts, lengths))
        return sample

    def _offsets(self, starts, lengths):
        """cu_seqlens and cu_seqlens_padded, -1-padded to one fixed length so that samples collate; the last
        padded span runs to the row's end (context parallelism cuts every span into 2 x CP chunks)."""
        entries = self.config.sequence_length // self.config.pad_multiple + 1
        real = [0] + np.cumsum(lengths).tolist()
        padded = starts + [self.config.sequence_length]

        def fixed(offsets):
            return torch.tensor(offsets + [-1] * (entries - len(offsets)), dtype=torch.int32)

        return {"cu_seqlens": fixed(real), "cu_seqlens_padded": fixed(padded),
                "max_seqlen": torch.tensor([max(lengths)], dtype=torch.int32)}


def _sft_dataset(low_level, indices, count, split, config):
    return SFTDataset(low_level, low_level.dataset_path, indices, count, split, config)


def _build_split(config, split, low_levels, ranges, weights, count):
    """One split's dataset: an SFTDataset, or a BlendedDataset over several files, shared by `weights` or, without
    them, by the files' numbers of conversations in the split; a list of one dataset per file for the valid split
    with `multiple_validation_sets`. `count` None serves one epoch of each file."""
    indices = [np.arange(begin, end, dtype=np.int64) for begin, end in ranges]
    if split is Split.valid and config.multiple_validation_sets:
        return [_sft_dataset(low, part, count, split, config) for low, part in zip(low_levels, indices)]
    if len(low_levels) == 1:
        return _sft_dataset(low_levels[0], indices[0], count, split, config)
    if count is None:
        parts = [_sft_dataset(low, part, None, split, config) for low, part in zip(low_levels, indices)]
        sizes = [len(part) for part in parts]
        return BlendedDataset(parts, sizes, sum(sizes), config)
    shares = normalize_weights(weights if weights is not None else [len(part) for part in indices],
                               len(low_levels)).tolist()
    targets = [math.ceil(count * share) for share in shares]
    parts = [_sft_dataset(low, part, target, split, config)
             for low, part, target in zip(low_levels, indices, targets)]
    return BlendedDataset(parts, shares, sum(targets), config)


def build_sft_datasets(config, train_valid_test_num_samples):
    """(train, valid, test) SFT datasets of the requested sizes (None: the whole split); a split is None when it gets
    no samples or no share of --split."""
    counts = tuple(train_valid_test_num_samples)
    if len(counts) != 3:
        raise ValueError(f"train_valid_test_num_samples must have three entries (got {counts})")
    results = []
    if config.blend_per_split is not None:
        for split, count, blend in zip(Split, counts, config.blend_per_split):
            if count == 0 or blend is None:
                results.append(None)
                continue
            low_levels = [SFTLowLevelDataset(path) for path in blend[0]]
            ranges = [(0, len(low)) for low in low_levels]
            results.append(_build_split(config, split, low_levels, ranges, blend[1], count))
        return tuple(results)
    paths, weights = config.blend
    low_levels = [SFTLowLevelDataset(path) for path in paths]
    ranges = [split_document_ranges(len(low), config.split) for low in low_levels]
    for split, count in zip(Split, counts):
        if count == 0 or config.split[split.value] == 0:
            results.append(None)
            continue
        results.append(_build_split(config, split, low_levels, [r[split.value] for r in ranges], weights, count))
    return tuple(results)

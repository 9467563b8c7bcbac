"""GPT pretraining datasets: documents packed into fixed-length samples, a mock variant, and the builder.

The token stream of a split is its documents concatenated in the (shuffled, per-epoch) document index
order; documents are separated by the eod token that `tools/preprocess_data.py --append-eod` stored at the
end of each. Sample i is the window of `sequence_length + 1` tokens starting at token `i * sequence_length`
of that stream; `tokens` are its first `sequence_length` tokens and `labels` its last.
"""

import concurrent.futures
import dataclasses
import hashlib
import math
import os
from typing import Any, Optional

import numpy as np
import torch

from megatron.core.datasets.blended_dataset import BlendedDataset, blending_schedule
from megatron.core.datasets.gpt_indices import build_gpt_indices, samples_in_tokens
from megatron.core.datasets.indexed_dataset import IndexedDataset, data_file_path, index_file_path
from megatron.core.datasets.utils import (
    Split,
    load_or_build_indices,
    normalize_weights,
    parse_split,
    sample_position,
    split_document_ranges,
)


@dataclasses.dataclass(frozen=True)
class GPTDatasetConfig:
    """What to read and how to cut it into samples.

    `blend` is `(prefixes, weights)` as parsed from `--data-path`, e.g.
    `(["a_text_document", "b_text_document"], [0.3, 0.7])`; weights None blends the datasets in proportion to
    their sizes (the samples one epoch of each split holds), as Megatron-Core does. Each dataset of a weighted
    blend holds `ceil(ceil(samples * share) * (1 + mid_level_dataset_surplus))` samples, as upstream's. `split`
    divides each dataset's documents into train/valid/test (`--split 969,30,1`); a blend needs one. `blend_per_split`
    instead names a blend (or None) for each of train, valid and test (`--train-data-path` ...), each using all of
    its datasets' documents; `split` must then be None, as upstream's.
    Neither a blend nor `mock` is a config without data, as upstream's: `BlendedMegatronDatasetBuilder` builds
    `MockGPTDataset`s from it, and `build_gpt_datasets` refuses it. `create_attention_mask` (default True, as
    upstream; `pretrain_gpt.py` sets it only for `--reset-attention-mask`) adds each sample's `[1, s, s]` mask.
    Index arrays are cached as .npy files in `path_to_cache`. `mmap_bin_files` False reads each sample's tokens
    from the `.bin` files instead of mapping them; `num_dataset_builder_threads` opens datasets and builds their
    indices in parallel; with `shared_filesystem` False the first rank of each node (not of the job) builds the
    cached indices.
    `multiple_validation_sets` (`--multiple-validation-sets`) makes the valid split a list with one dataset per
    validation prefix (given without weights) instead of their blend.

    Upstream's other fields are accepted at their defaults: `full_validation` (recorded: a valid size of None asks
    for the whole split), `add_extra_token_to_sequence` True, `drop_last_partial_validation_sequence` True and
    `object_storage_cache_path` None; other values are refused with what to do. `split_matrix` is upstream's
    `[(begin, end) or None]` per split.
    Labels equal to the tokenizer's padding id get no loss, as upstream's (see `pad_token_id`).
    """

    random_seed: int
    sequence_length: int
    blend: Optional[tuple] = None
    split: Optional[str] = None
    path_to_cache: Optional[str] = None
    tokenizer: Any = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask: bool = True
    mock: bool = False
    blend_per_split: Optional[tuple] = None
    mmap_bin_files: bool = True
    num_dataset_builder_threads: int = 1
    shared_filesystem: bool = True
    multiple_validation_sets: bool = False
    mid_level_dataset_surplus: float = 0.005
    full_validation: Optional[bool] = None
    add_extra_token_to_sequence: bool = True
    drop_last_partial_validation_sequence: bool = True
    object_storage_cache_path: Optional[str] = None

    def __post_init__(self):
        if int(self.sequence_length) < 1:
            raise ValueError(f"--seq-length must be a positive integer (got {self.sequence_length})")
        if not float(self.mid_level_dataset_surplus) >= 0:
            raise ValueError(f"--mid-level-dataset-surplus must be >= 0 (got {self.mid_level_dataset_surplus})")
        if int(self.num_dataset_builder_threads) < 1:
            raise ValueError(
                f"--num-dataset-builder-threads must be at least 1 (got {self.num_dataset_builder_threads})")
        self._refuse_unsupported_upstream_fields()
        if self.blend is not None and self.blend_per_split is not None:
            raise ValueError("--data-path and --train-data-path / --valid-data-path / --test-data-path are exclusive")
        if self.split is None and self.blend is not None and not self.mock:
            raise ValueError("a blend (--data-path) needs split, e.g. split='969,30,1' (--split)")
        if self.split is not None and self.blend_per_split is not None and not self.mock:
            raise ValueError(f"split ({self.split!r}, --split) and blend_per_split (--train-data-path / "
                             "--valid-data-path / --test-data-path) are exclusive, as upstream's: each split of "
                             "blend_per_split reads all of its datasets' documents; leave split None (drop --split)")
        # Upstream splits mock data evenly; neither it nor a per-split blend reads the fractions.
        object.__setattr__(self, "split_fractions", parse_split("1,1,1" if self.split is None else self.split))
        split_matrix = None
        if self.blend_per_split is None:
            bounds = np.concatenate([[0.0], np.cumsum(self.split_fractions)])
            split_matrix = [(float(begin), float(end)) if end > begin else None
                            for begin, end in zip(bounds[:-1], bounds[1:])]
        object.__setattr__(self, "split_matrix", split_matrix)
        if self.mock:
            if self.tokenizer is None:
                raise ValueError("--mock-data needs a tokenizer (e.g. --tokenizer-type NullTokenizer --vocab-size N)")
        elif self.blend_per_split is not None:
            if len(self.blend_per_split) != 3 or all(blend is None for blend in self.blend_per_split):
                raise ValueError("blend_per_split needs three entries (train, valid, test), at least one a blend")
            object.__setattr__(self, "blend_per_split", tuple(
                None if blend is None else self._normalized_blend(blend) for blend in self.blend_per_split))
        elif self.blend is not None:
            object.__setattr__(self, "blend", self._normalized_blend(self.blend))
        if self.multiple_validation_sets:
            valid_blend = self.blend_per_split[1] if self.blend_per_split is not None else self.blend
            if self.mock or (valid_blend is not None and valid_blend[1] is not None):
                raise ValueError("--multiple-validation-sets evaluates each validation dataset on its own: give "
                                 "their prefixes without weights (--valid-data-path A B C), not --mock-data")
        needs_eod = self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss
        if needs_eod and self.tokenizer is None:
            raise ValueError(
                "--reset-position-ids / --reset-attention-mask / --eod-mask-loss need a tokenizer for the eod id"
            )

    def _refuse_unsupported_upstream_fields(self):
        if not self.add_extra_token_to_sequence:
            raise ValueError("add_extra_token_to_sequence=False (samples of sequence_length tokens whose last label "
                             "is padding) is not supported: leave it True, each sample then reads sequence_length + 1 "
                             "tokens, upstream's default")
        if not self.drop_last_partial_validation_sequence:
            raise ValueError("drop_last_partial_validation_sequence=False (a padded last validation sample) is not "
                             "supported: leave it True, the validation split then drops its last partial sample")
        if self.object_storage_cache_path is not None:
            raise ValueError("object_storage_cache_path: object storage (--object-storage-cache-path) is not "
                             "supported; copy the .bin/.idx files to a local or shared filesystem and give their "
                             "prefixes")

    @staticmethod
    def _normalized_blend(blend):
        if not (isinstance(blend, (tuple, list)) and len(blend) == 2 and isinstance(blend[0], (tuple, list))):
            raise ValueError(
                f"blend {blend!r} must be (prefixes, weights or None); parse --data-path with blend_from_data_path"
            )
        prefixes, weights = tuple(str(prefix) for prefix in blend[0]), blend[1]
        if not prefixes:
            raise ValueError("--data-path names no dataset")
        if weights is not None:
            weights = tuple(float(weight) for weight in weights)
            normalize_weights(weights, len(prefixes))  # validates count and signs
        return prefixes, weights


# Upstream's padding id for a tokenizer without a padding token of its own: no real token id, so nothing is masked.
PAD_TOKEN_ID = -1


def _eod(config):
    return None if config.tokenizer is None else int(config.tokenizer.eod)


def pad_token_id(tokenizer):
    """The id whose labels get no loss: the tokenizer's own padding id, else `PAD_TOKEN_ID`.

    Tokenizers here answer `pad` with their eod when they have no padding token (NullTokenizer, GPT-2's): that is
    no padding token, as upstream's NullTokenizer and GPT-2 tokenizer have none, so eod labels keep their loss.
    """
    if tokenizer is None:
        return PAD_TOKEN_ID
    try:
        pad = tokenizer.pad
    except (AttributeError, NotImplementedError):
        return PAD_TOKEN_ID
    if pad is None or int(pad) == int(tokenizer.eod):
        return PAD_TOKEN_ID
    return int(pad)


def sample_from_tokens(token_window, config):
    """The training dict for one window of `sequence_length + 1` token ids (a numpy array).

    As upstream's: labels equal to the padding id (`pad_token_id`) get no loss, and padding ids in tokens and
    labels read as id 0 so the embedding can look them up.
    """
    window = torch.from_numpy(np.asarray(token_window, dtype=np.int64))
    tokens, labels = window[:-1].contiguous(), window[1:].contiguous()
    length = tokens.numel()
    eod = _eod(config)
    loss_mask = torch.ones(length, dtype=torch.float32)
    position_ids = torch.arange(length, dtype=torch.int64)
    eod_positions = (tokens == eod).nonzero().flatten() if eod is not None else torch.empty(0, dtype=torch.int64)
    if config.eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    if config.reset_position_ids and eod_positions.numel():
        # Each document restarts its positions at 0 after the eod that closes the previous one.
        document_starts = torch.zeros(length, dtype=torch.int64)
        next_starts = eod_positions[eod_positions + 1 < length] + 1
        document_starts[next_starts] = next_starts
        position_ids = position_ids - torch.cummax(document_starts, dim=0).values
    pad = pad_token_id(config.tokenizer)
    loss_mask[labels == pad] = 0.0
    tokens = torch.where(tokens == pad, 0, tokens)
    labels = torch.where(labels == pad, 0, labels)
    sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
    if config.create_attention_mask:
        allowed = torch.tril(torch.ones(length, length, dtype=torch.bool))
        if config.reset_attention_mask:
            for position in eod_positions.tolist():
                allowed[position + 1 :, : position + 1] = False
        sample["attention_mask"] = (~allowed).unsqueeze(0)  # True = masked out, Megatron's convention
    return sample


def _without_loss(sample):
    return {**sample, "loss_mask": torch.zeros_like(sample["loss_mask"])}


class GPTDataset(torch.utils.data.Dataset):
    """Packed samples from the documents `indexed_indices` of `indexed_dataset`: all the samples of the epochs that
    `num_samples` needs (one epoch for None), so at least `num_samples`, as upstream's.

    Upstream's signature: `GPTDataset(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split,
    config)`, `indexed_indices` the document ids (`numpy.arange(begin, end)` for a split of `--split`) and
    `dataset_path` the prefix (None: the indexed dataset's own). Upstream's attribute names (`dataset`,
    `dataset_path`, `indices`, `index_split`) are kept next to `indexed_dataset`, `split` and `document_range`
    (`(begin, end)` when the documents are contiguous, else None).
    Every sequence of the indexed dataset counts as one document (what the preprocessing tool writes).
    """

    def __init__(self, indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config=None):
        if isinstance(dataset_path, GPTDatasetConfig) or not isinstance(config, GPTDatasetConfig):
            raise TypeError("GPTDataset takes upstream's arguments (indexed_dataset, dataset_path, indexed_indices, "
                            "num_samples, index_split, config), e.g. GPTDataset(indexed, prefix, numpy.arange(begin, "
                            f"end), num_samples, Split.train, config); got a {type(dataset_path).__name__} as "
                            f"dataset_path and a {type(config).__name__} as config")
        self.indexed_dataset = self.dataset = indexed_dataset
        self.dataset_path = indexed_dataset.path_prefix if dataset_path is None else dataset_path
        self.config = config
        self.split = self.index_split = Split(index_split)
        split = self.split
        documents = np.ascontiguousarray(np.asarray(indexed_indices, dtype=np.int64).reshape(-1))
        self.indices = documents
        self.num_samples = None if num_samples is None else int(num_samples)
        if documents.size == 0 and len(indexed_dataset) == 0:
            raise ValueError(f"{indexed_dataset.path_prefix} holds no tokens ({indexed_dataset.num_documents} "
                             "documents, all empty: was its input empty?): drop it from the data path flags")
        if documents.size == 0:
            raise ValueError(
                f"the {split.name} split of {indexed_dataset.path_prefix} ({len(indexed_dataset)} documents) has no "
                "documents; adjust --split"
            )
        if documents.min() < 0 or documents.max() >= len(indexed_dataset):
            raise IndexError(f"indexed_indices of the {split.name} split name documents outside [0, "
                             f"{len(indexed_dataset)}) of {indexed_dataset.path_prefix}")
        contiguous = bool(np.array_equal(documents, np.arange(documents[0], documents[0] + documents.size)))
        self.document_range = (int(documents[0]), int(documents[0]) + documents.size) if contiguous else None
        description = {
            "class": type(self).__name__,
            "path_prefix": os.path.abspath(indexed_dataset.path_prefix),
            "index_bytes": os.path.getsize(index_file_path(indexed_dataset.path_prefix)),
            "data_bytes": os.path.getsize(data_file_path(indexed_dataset.path_prefix)),
            "split": split.name,
            "document_range": list(self.document_range) if contiguous else None,
            "sequence_length": int(config.sequence_length),
            "num_samples": None if num_samples is None else int(num_samples),
            "random_seed": int(config.random_seed),
        }
        if not contiguous:
            description["document_indices_blake2b"] = hashlib.blake2b(documents, digest_size=16).hexdigest()
        if config.path_to_cache is not None:
            # The indices follow from the split's sequence lengths: data preprocessed again into files of the same
            # sizes (e.g. its documents in another order) gets indices of its own, not the earlier data's.
            lengths = np.ascontiguousarray(
                indexed_dataset.sequence_lengths[self.document_range[0]:self.document_range[1]] if contiguous
                else np.asarray(indexed_dataset.sequence_lengths)[documents])
            description["sequence_lengths_blake2b"] = hashlib.blake2b(lengths, digest_size=16).hexdigest()
        arrays, self.indices_loaded_from_cache = load_or_build_indices(
            config.path_to_cache,
            f"{type(self).__name__}-{split.name}",
            description,
            lambda: build_gpt_indices(
                indexed_dataset.sequence_lengths, documents, config.sequence_length, num_samples, config.random_seed
            ),
        )
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self):
        return len(self.shuffle_index)

    @staticmethod
    def build_low_level_dataset(dataset_path, config):
        """Upstream's: the `IndexedDataset` of prefix `dataset_path`, memory-mapped as `config.mmap_bin_files` says."""
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset):
        """Upstream's: the number of documents (sequences) of an `IndexedDataset`, the range `indexed_indices`
        picks from."""
        return low_level_dataset.sequence_lengths.shape[0]

    def document_pieces(self, idx):
        """[(document id, its token ids in the window)] of sample `idx` (before any shuffling), in window order."""
        first_position, first_offset = (int(value) for value in self.sample_index[idx])
        last_position, last_offset = (int(value) for value in self.sample_index[idx + 1])
        read = self.indexed_dataset.get

        def document(position):
            return int(self.document_index[position])

        if first_position == last_position:
            return [(document(first_position),
                     read(document(first_position), first_offset, last_offset - first_offset + 1))]
        pieces = [(document(first_position), read(document(first_position), first_offset))]
        for position in range(first_position + 1, last_position):
            pieces.append((document(position), read(document(position))))
        pieces.append((document(last_position), read(document(last_position), 0, last_offset + 1)))
        return pieces

    def token_window(self, idx):
        """The `sequence_length + 1` token ids of sample `idx` (before any shuffling: use `shuffle_index`)."""
        pieces = self.document_pieces(idx)
        return pieces[0][1] if len(pieces) == 1 else np.concatenate([tokens for _, tokens in pieces])

    def __getitem__(self, idx):
        """Sample `idx`; None is upstream's batch-padding sample: sample 0 with no loss on any token."""
        if idx is None:
            return _without_loss(self[0])
        idx = sample_position(idx, len(self), f"a {self.split.name} dataset")
        window = self.token_window(int(self.shuffle_index[idx]))
        limit = self.token_id_limit
        if limit is not None and window.size and (int(window.max()) >= limit or int(window.min()) < 0):
            raise ValueError(self._token_id_error(idx, limit))
        return sample_from_tokens(window, self.config)

    # Set by `limit_token_ids`: a sample holding a token id outside [0, limit) raises, naming its documents.
    token_id_limit = None
    token_id_limit_explanation = None

    def _token_id_error(self, idx, limit):
        pieces = self.document_pieces(int(self.shuffle_index[idx]))
        outside = [(document, tokens[(tokens >= limit) | (tokens < 0)]) for document, tokens in pieces]
        outside = [(document, ids) for document, ids in outside if ids.size]
        ids = np.concatenate([ids for _, ids in outside])
        token_id = int(ids.max()) if ids.max() >= limit else int(ids.min())
        documents = list(dict.fromkeys(document for document, _ in outside))
        documents = ("document " if len(documents) == 1 else "documents ") + ", ".join(map(str, documents))
        prefix = self.indexed_dataset.path_prefix
        explanation = self.token_id_limit_explanation or f"outside the {limit} token ids the model has embeddings for"
        return (f"sample {idx} of the {self.split.name} split read from dataset {prefix} holds token id {token_id} "
                f"({documents} of {prefix}.bin), {explanation}")


def limit_token_ids(dataset, limit, explanation=None):
    """Make every GPTDataset in `dataset` (a GPTDataset, a blend of them, or a list of such) raise on reading a
    sample that holds a token id outside `[0, limit)`, naming its dataset prefix and documents, followed by
    `explanation` (what the limit is and what to do). One comparison per sample; returns nothing."""
    if isinstance(dataset, (list, tuple)):
        for part in dataset:
            limit_token_ids(part, limit, explanation)
    elif isinstance(dataset, BlendedDataset):
        for part in dataset.datasets:
            limit_token_ids(part, limit, explanation)
    elif isinstance(dataset, GPTDataset):
        dataset.token_id_limit = None if limit is None else int(limit)
        dataset.token_id_limit_explanation = explanation


class MockGPTDataset(torch.utils.data.Dataset):
    """`num_samples` samples of random token ids, reproducible from (seed, split, sample index); no files.

    Ids are drawn uniformly from every id of the tokenizer's vocabulary except its eod, so the eod never appears:
    `[0, eod)` when the eod is the last id (NullTokenizer's `--vocab-size N`: the text ids `0 .. N - 1`; GPT-2's
    50256), and otherwise `[0, vocab_size - 1)` with the ids from the eod on moved up by one, skipping it.
    Upstream's signature: `MockGPTDataset(dataset, dataset_path, indices, num_samples, index_split, config)`; the
    samples do not come from documents, so `dataset`, `dataset_path` and `indices` are only kept as attributes.
    """

    def __init__(self, dataset, dataset_path, indices, num_samples=None, index_split=None, config=None):
        if isinstance(dataset, GPTDatasetConfig) or not isinstance(config, GPTDatasetConfig):
            raise TypeError("MockGPTDataset takes upstream's arguments (dataset, dataset_path, indices, num_samples, "
                            "index_split, config), e.g. MockGPTDataset(None, None, None, num_samples, Split.train, "
                            f"config); got a {type(dataset).__name__} as dataset and a {type(config).__name__} as "
                            "config")
        if num_samples is None:
            raise ValueError("MockGPTDataset has no natural size: give num_samples")
        self.dataset, self.dataset_path, self.indices = dataset, dataset_path, indices
        self.config = config
        self.split = self.index_split = Split(index_split)
        self.num_samples = int(num_samples)
        self.vocab_size = int(config.tokenizer.vocab_size)
        self.eod = int(config.tokenizer.eod)
        if self.vocab_size < 2:
            raise ValueError(f"--mock-data needs a vocabulary with at least one id besides the eod (got "
                             f"{self.vocab_size} ids; NullTokenizer: --vocab-size of at least 1)")
        if not 0 <= self.eod < self.vocab_size:
            raise ValueError(f"--mock-data needs the tokenizer's eod id ({self.eod}) inside its vocabulary "
                             f"[0, {self.vocab_size})")

    def __len__(self):
        return self.num_samples

    def token_window(self, idx):
        rng = np.random.default_rng([int(self.config.random_seed), self.split.value, int(idx)])
        token_ids = rng.integers(0, self.vocab_size - 1, size=self.config.sequence_length + 1, dtype=np.int64)
        return token_ids + (token_ids >= self.eod)

    def __getitem__(self, idx):
        """Sample `idx`; None is upstream's batch-padding sample: sample 0 with no loss on any token."""
        if idx is None:
            return _without_loss(self[0])
        idx = sample_position(idx, self.num_samples, "a mock dataset")
        return sample_from_tokens(self.token_window(idx), self.config)


def check_data_files(prefixes):
    """Raise naming --data-path when a dataset prefix lacks its .idx or .bin file."""
    missing = []
    for prefix in prefixes:
        missing += [path for path in (index_file_path(prefix), data_file_path(prefix)) if not os.path.isfile(path)]
    if missing:
        quoted = [prefix for prefix in prefixes if len(prefix.split()) > 1]
        hint = (f"; {quoted[0]!r} looks like several words passed as one argument: give weights and prefixes as "
                "separate words, --data-path 0.3 A 0.7 B, not one quoted string" if quoted else "")
        raise FileNotFoundError(
            f"--data-path names datasets whose files do not exist: {', '.join(missing)} "
            "(give the prefix without .bin/.idx, e.g. my_corpus_text_document; build it with tools/preprocess_data.py)"
            + hint
        )


def _map(config, function, items):
    """`[function(item)]`, on `config.num_dataset_builder_threads` threads (index building is numpy work)."""
    if config.num_dataset_builder_threads == 1 or len(items) < 2:
        return [function(item) for item in items]
    with concurrent.futures.ThreadPoolExecutor(config.num_dataset_builder_threads) as pool:
        return list(pool.map(function, items))


def _open_indexed(config, prefixes):
    check_data_files(prefixes)
    return _map(config, lambda prefix: IndexedDataset(prefix, mmap=config.mmap_bin_files), list(prefixes))


def _gpt_dataset(indexed_dataset, document_range, num_samples, split, config):
    """The GPTDataset of the documents `[begin, end)` of `indexed_dataset`, built as upstream's builder does."""
    return GPTDataset(indexed_dataset, indexed_dataset.path_prefix, np.arange(*document_range, dtype=np.int64),
                      num_samples, split, config)


def _build_split(config, split, weights, indexed, document_ranges, count, split_fractions):
    """The dataset of one split: a GPTDataset, or a BlendedDataset over several (their `document_ranges`); a list
    of one GPTDataset per dataset for the valid split with `multiple_validation_sets`. `split_fractions` is None
    for a split with its own blend (`--train-data-path` ...).

    As Megatron-Core's builder: a weighted blend of `count` samples holds `sum(ceil(count * share))` of them and
    each of its datasets `ceil(ceil(count * share) * (1 + surplus))`; a blend without weights is scheduled by the
    datasets' sizes (the weights then normalised once instead of twice) and holds at most one epoch of each.
    One weighted `--data-path` prefix (`--data-path 1.0 A`) is a blend of one dataset, built with the surplus,
    while a split's own single prefix is not. `count` None asks for the whole split (`--full-validation`): one
    epoch of each dataset, blended in proportion to their sizes (the weights do not apply), so every sample of
    every dataset is served exactly once.
    """
    if split is Split.valid and config.multiple_validation_sets:
        return [_gpt_dataset(dataset, document_range, count, split, config)
                for dataset, document_range in zip(indexed, document_ranges)]
    if len(indexed) == 1 and (weights is None or split_fractions is None or count is None):
        return _gpt_dataset(indexed[0], document_ranges[0], count, split, config)
    weighted = weights is not None
    blend_description = {
        "prefixes": [os.path.abspath(dataset.path_prefix) for dataset in indexed],
        "split": split.name,
        "split_fractions": split_fractions,
        "weighted": weighted,
        "sequence_length": int(config.sequence_length),
    }
    whole_split = count is None
    if whole_split:
        parts = _map(config, lambda part: _gpt_dataset(part[0], part[1], None, split, config),
                     list(zip(indexed, document_ranges)))
        weights, count = [len(part) for part in parts], sum(len(part) for part in parts)
    elif weights is None:
        # One epoch of each dataset, blended by their sizes; the blend holds at most all of their samples.
        weights = _samples_per_epoch(config, split, indexed, document_ranges)
        count = min(count, sum(weights))
    else:
        # Upstream's builder normalises the weights, sizes the blend by them, and its BlendedDataset normalises
        # them again for the schedule.
        weights = normalize_weights(weights, len(indexed)).tolist()
        targets = [math.ceil(count * share) for share in weights]
        count = sum(targets)
    dataset_index, dataset_sample_index = blending_schedule(weights, count, config.path_to_cache, blend_description)
    if not whole_split:
        # The size of each dataset of a weighted blend sets its number of epochs and so its shuffles.
        samples_per_dataset = ([math.ceil(target * (1 + config.mid_level_dataset_surplus)) for target in targets]
                               if weighted else [None] * len(indexed))
        parts = _map(config, lambda part: _gpt_dataset(part[0], part[1], part[2], split, config),
                     list(zip(indexed, document_ranges, samples_per_dataset)))
    return BlendedDataset(parts, weights, count, config, dataset_index, dataset_sample_index)


def _samples_per_epoch(config, split, indexed, document_ranges):
    """Samples one epoch of each dataset's split holds: the shares of a blend given without weights."""
    counts = []
    for dataset, (begin, end) in zip(indexed, document_ranges):
        tokens = int(np.asarray(dataset.sequence_lengths[begin:end], dtype=np.int64).sum())
        counts.append(samples_in_tokens(tokens, config.sequence_length))
        if counts[-1] == 0:
            raise ValueError(
                f"the {split.name} split of {dataset.path_prefix} ({end - begin} documents, {tokens} tokens) does not "
                f"fill one sample of --seq-length {config.sequence_length} + 1 tokens: drop the prefix, give weights, "
                "or adjust --split"
            )
    return counts


def _build_split_datasets(config, train_valid_test_num_samples):
    if config.mock:
        if None in train_valid_test_num_samples:
            raise ValueError("--mock-data has no natural size to evaluate in full: --full-validation needs "
                             "--data-path or --valid-data-path datasets")
        return tuple(
            MockGPTDataset(None, None, None, count, split, config) if count else None
            for split, count in zip(Split, train_valid_test_num_samples)
        )
    if config.blend_per_split is not None:  # each split its own datasets, all of their documents
        results = []
        for split, count, blend in zip(Split, train_valid_test_num_samples, config.blend_per_split):
            if count == 0 or blend is None:
                results.append(None)
                continue
            indexed = _open_indexed(config, blend[0])
            whole = [(0, len(dataset)) for dataset in indexed]
            results.append(_build_split(config, split, blend[1], indexed, whole, count, None))
        return tuple(results)
    prefixes, weights = config.blend
    indexed = _open_indexed(config, prefixes)
    ranges = [split_document_ranges(len(dataset), config.split_fractions) for dataset in indexed]
    results = []
    for split, count in zip(Split, train_valid_test_num_samples):
        if count == 0 or config.split_fractions[split.value] == 0:
            results.append(None)
            continue
        split_ranges = [dataset_ranges[split.value] for dataset_ranges in ranges]
        results.append(_build_split(config, split, weights, indexed, split_ranges, count,
                                    list(config.split_fractions)))
    return tuple(results)


def build_gpt_datasets(config, train_valid_test_num_samples, built_on_rank=True):
    """(train, valid, test) datasets; a split is None when it gets no samples or no share of `--split`.

    A count of None asks for the whole split (one epoch of its datasets, `--full-validation`).

    With `torch.distributed` initialised and a cache directory, rank 0 builds (and caches) the indices
    first and the other ranks then load them, so the work is done once; without a shared filesystem
    (`shared_filesystem` False) the first rank of each node (LOCAL_RANK 0) builds them for its node.
    A rank with `built_on_rank` False builds nothing and gets (None, None, None); it still takes part in
    that synchronisation, so every rank calls this.
    """
    counts = tuple(train_valid_test_num_samples)
    if not config.mock and config.blend is None and config.blend_per_split is None:
        raise ValueError("no data: give --data-path PREFIX [PREFIX ...] (or --mock-data); for --train-data-path "
                         "/ --valid-data-path / --test-data-path the datasets provider must pass them as "
                         "blend_per_split (megatron.training.datasets.gpt_dataset_config builds the config)")
    if len(counts) != 3:
        raise ValueError(f"train_valid_test_num_samples must have three entries (got {counts})")
    nothing = (None, None, None)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or config.path_to_cache is None or torch.distributed.get_world_size() == 1:
        return _build_split_datasets(config, counts) if built_on_rank else nothing
    builds_cache_first = _builds_index_cache(config)
    datasets = nothing
    if builds_cache_first and built_on_rank:
        datasets = _build_split_datasets(config, counts)
    torch.distributed.barrier()
    if not builds_cache_first and built_on_rank:
        datasets = _build_split_datasets(config, counts)
    return datasets


def _builds_index_cache(config):
    if config.shared_filesystem:
        return torch.distributed.get_rank() == 0
    return int(os.environ.get("LOCAL_RANK", torch.distributed.get_rank())) == 0

"""`BlendedDataset`: several datasets mixed by weight with a fixed, reproducible sample schedule."""

import numpy as np
import torch

from megatron.core.datasets.utils import (
    build_blending_indices,
    load_or_build_indices,
    normalize_weights,
    sample_position,
)


def blending_schedule(weights, size, path_to_cache=None, description=None):
    """(dataset_index, dataset_sample_index) for `size` samples, cached in `path_to_cache` when given.

    `description` identifies the blend in the cache key (dataset names, split, seed, ...). The weights go to
    `build_blending_indices` as given (it normalises them once, as upstream's `BlendedDataset` does).
    """
    normalize_weights(weights, len(weights))  # validates count and signs
    weights = [float(weight) for weight in weights]
    key = {"weights": weights, "size": int(size), "blend": description}
    arrays, _ = load_or_build_indices(
        path_to_cache,
        "BlendedDataset",
        key,
        lambda: dict(zip(("dataset_index", "dataset_sample_index"), build_blending_indices(weights, size))),
    )
    return arrays["dataset_index"], arrays["dataset_sample_index"]


def _blend_description(datasets):
    """What identifies a blend of `datasets` in the schedule's cache key: each dataset's prefix, split and size."""
    return [None if dataset is None else [str(getattr(dataset, "dataset_path", type(dataset).__name__)),
                                          str(getattr(getattr(dataset, "split", None), "name", None)), len(dataset)]
            for dataset in datasets]


class BlendedDataset(torch.utils.data.Dataset):
    """Sample i is `datasets[dataset_index[i]][dataset_sample_index[i]]`.

    The schedule gives every dataset its weighted share within one sample (see `build_blending_indices`).
    A dataset whose share is zero samples may be None.
    `config` is upstream's fourth argument (the datasets' `GPTDatasetConfig`): the schedule is then cached in its
    `path_to_cache`. `split` is the datasets' split. A dict sample (GPT's) gains upstream's `dataset_id`, the
    position of its dataset in `datasets` (a numpy int16 scalar, an int16 tensor once batched); the training step
    reads only the keys it needs.
    """

    def __init__(self, datasets, weights, size, config=None, dataset_index=None, dataset_sample_index=None):
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights, len(self.datasets))
        self.size = int(size)
        self.config = config
        splits = {getattr(dataset, "split", None) for dataset in self.datasets if dataset is not None}
        self.split = splits.pop() if len(splits) == 1 else None
        if dataset_index is None:
            dataset_index, dataset_sample_index = blending_schedule(
                weights, self.size, getattr(config, "path_to_cache", None), _blend_description(self.datasets))
        if len(dataset_index) != self.size or len(dataset_sample_index) != self.size:
            raise ValueError(f"blending schedule has {len(dataset_index)} entries for {self.size} samples")
        self.dataset_index = dataset_index
        self.dataset_sample_index = dataset_sample_index
        self.samples_per_dataset = np.bincount(np.asarray(dataset_index), minlength=len(self.datasets))
        for position, (dataset, needed) in enumerate(zip(self.datasets, self.samples_per_dataset)):
            available = 0 if dataset is None else len(dataset)
            if needed > available:
                raise ValueError(f"blended dataset {position} has {available} samples, the schedule needs {needed}")

    def __len__(self):
        return self.size

    def __getitem__(self, idx):
        idx = sample_position(idx, self.size, "a blended dataset")
        dataset_id = self.dataset_index[idx]
        sample = self.datasets[int(dataset_id)][int(self.dataset_sample_index[idx])]
        if isinstance(sample, dict):
            return {"dataset_id": dataset_id, **sample}
        return sample

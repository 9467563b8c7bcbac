"""Upstream's `BlendedMegatronDatasetBuilder(cls, sizes, is_built_on_rank, config).build()` over
`gpt_dataset.build_gpt_datasets`.

`cls` picks the data: `MockGPTDataset` builds random token ids whatever the config's blend (upstream's mock
config is a `GPTDatasetConfig` without one), `GPTDataset` reads the config's `--data-path` blend. A size of None
asks for the whole split of real data (`--full-validation`); mock data has no natural size, so there None
builds no dataset for that split.
"""

import dataclasses

from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset, build_gpt_datasets


class BlendedMegatronDatasetBuilder:
    """Builds the (train, valid, test) datasets of `sizes` samples each from `config` (a `GPTDatasetConfig`).

    `is_built_on_rank()` False leaves this rank without datasets (None for each split); every rank must still
    call `build()`, which synchronises ranks around the index cache.
    """

    def __init__(self, cls, sizes, is_built_on_rank, config):
        if cls not in (GPTDataset, MockGPTDataset):
            raise TypeError(f"BlendedMegatronDatasetBuilder builds GPTDataset or MockGPTDataset, got {cls!r}; "
                            "for other datasets build them yourself and pass a DataLoader over them")
        sizes = list(sizes)
        if len(sizes) != 3:
            raise ValueError(f"sizes must have three entries (train, valid, test), got {sizes}")
        if cls is GPTDataset and config.mock:
            raise ValueError("the config asks for mock data (mock=True): build MockGPTDataset, or give a blend "
                             "(--data-path) without mock to build GPTDataset")
        self.cls = cls
        self.sizes = sizes
        self.is_built_on_rank = is_built_on_rank
        self.config = config

    def build(self):
        """[train, valid, test]: each a dataset, or None where its size is 0 (or None for mock data), the split
        has no share of `--split`, or this rank builds nothing."""
        config, sizes = self.config, self.sizes
        if self.cls is MockGPTDataset:
            config = dataclasses.replace(config, mock=True, blend=None, blend_per_split=None)
            sizes = [0 if size is None else size for size in sizes]
        return list(build_gpt_datasets(config, sizes, built_on_rank=bool(self.is_built_on_rank())))

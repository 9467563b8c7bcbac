"""Pretraining data: indexed token files, packed GPT samples, weighted blends.

- `indexed_dataset`: the `.bin`/`.idx` format (writer, validated memory-mapped reader);
- `gpt_indices`: pure-numpy document / sample / shuffle index construction;
- `gpt_dataset`: `GPTDatasetConfig`, `GPTDataset`, `MockGPTDataset`, `build_gpt_datasets`;
- `blended_dataset`: `BlendedDataset` and its weighted schedule;
- `utils`: `--split` and `--data-path` parsing, the blending schedule, the .npy index cache.

Submodules are imported explicitly (this package imports nothing), so tools that only need the file
format do not pay for importing torch.
"""

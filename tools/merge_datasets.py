"""Merge every indexed dataset (`.bin`/`.idx` pair) in a directory into one dataset.

    python tools/merge_datasets.py --input shards/ --output-prefix merged_text_document

The datasets are appended in the sorted order of their prefixes (as upstream's tool does), each document kept
whole, so merging the outputs of `tools/preprocess_data.py` run on `a.jsonl` and `b.jsonl` gives the same bytes as
running it once on `a.jsonl` followed by `b.jsonl`. Name the shards so that they sort in the order wanted
(`part_02` before `part_10`). Files in the directory other than `.bin`/`.idx` are left out; a `.bin` without its
`.idx` (or the reverse) is an error. All datasets must hold the same token dtype (the same tokenizer).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexFileError,
    data_file_path,
    index_file_path,
)

DATASET_SUFFIXES = (".bin", ".idx")
PARTIAL_SUFFIX = ".partial"


def find_dataset_prefixes(directory):
    """Sorted path prefixes of the `.bin`/`.idx` pairs in `directory`; raises naming a file without its pair."""
    names = sorted(os.listdir(directory))
    stems = {}
    for name in names:
        stem, suffix = os.path.splitext(name)
        if suffix in DATASET_SUFFIXES and os.path.isfile(os.path.join(directory, name)):
            stems.setdefault(stem, set()).add(suffix)
    unpaired = [os.path.join(directory, stem + "".join(found)) for stem, found in stems.items() if len(found) != 2]
    if unpaired:
        raise ValueError(f"--input {directory}: {', '.join(sorted(unpaired))} "
                         f"{'has' if len(unpaired) == 1 else 'have'} no matching .bin/.idx file; every dataset "
                         "needs both (remove the stray file or restore its pair)")
    return [os.path.join(directory, stem) for stem in sorted(stems)]


def merge_datasets(prefixes, output_prefix):
    """Append the datasets at `prefixes`, in that order, into `output_prefix.bin/.idx`; returns the output prefix.

    Every input is opened and checked (index valid, same dtype) before anything is written; a failure part way
    leaves no output of its own behind, and a dataset already at `output_prefix` as it was.
    """
    if not prefixes:
        raise ValueError("no datasets to merge")
    output_paths = {os.path.abspath(data_file_path(output_prefix)), os.path.abspath(index_file_path(output_prefix))}
    dtype = None
    for prefix in prefixes:
        if os.path.abspath(data_file_path(prefix)) in output_paths:
            raise ValueError(f"--output-prefix {output_prefix} is one of the inputs; write the merged dataset "
                             "under another name (or outside the --input directory)")
        dataset = IndexedDataset(prefix)
        if dtype is None:
            dtype, first = dataset.dtype, prefix
        elif dataset.dtype != dtype:
            raise ValueError(f"cannot merge {prefix} ({dataset.dtype.name} tokens) with {first} ({dtype.name} "
                             "tokens): the datasets were written with tokenizers of different vocabulary sizes; "
                             "merge only datasets made with one tokenizer")
        del dataset  # release the memory maps
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    # Written under .partial names and renamed at the end: a failed merge leaves an earlier output as it was.
    builder = IndexedDatasetBuilder(data_file_path(output_prefix) + PARTIAL_SUFFIX, dtype=dtype)
    try:
        for prefix in prefixes:
            builder.add_index(prefix)
    except BaseException:
        builder.close()
        os.remove(data_file_path(output_prefix) + PARTIAL_SUFFIX)
        raise
    builder.finalize(index_file_path(output_prefix) + PARTIAL_SUFFIX)
    for path in (data_file_path(output_prefix), index_file_path(output_prefix)):
        os.replace(path + PARTIAL_SUFFIX, path)
    return output_prefix


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Merge every .bin/.idx dataset in a directory into one dataset.")
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True,
                       help="directory holding the datasets to merge (appended in the sorted order of their names)")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    group = parser.add_argument_group("miscellaneous")
    group.add_argument("--multimodal", action="store_true",
                       help="not supported: multimodal datasets (with per-sequence modes) cannot be read here")
    args = parser.parse_args(argv)
    if args.multimodal:
        parser.error("--multimodal is not supported: this indexed dataset format has no sequence modes; merge "
                     "text datasets without the flag")
    if not os.path.isdir(args.input):
        parser.error(f"--input {args.input!r} is not a directory (give the directory holding the .bin/.idx files)")
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        prefixes = find_dataset_prefixes(args.input)
        if not prefixes:
            raise ValueError(f"--input {args.input}: no .bin/.idx datasets in this directory")
        merge_datasets(prefixes, args.output_prefix)
    except (ValueError, FileNotFoundError, IndexFileError) as error:
        raise SystemExit(f"merge_datasets.py: {error}; nothing was written") from error
    merged = IndexedDataset(args.output_prefix)
    print(f"merged {len(prefixes)} datasets into {args.output_prefix}: {merged.num_documents} documents, "
          f"{len(merged)} sequences, {int(merged.sequence_lengths.sum(dtype='int64'))} tokens", file=sys.stderr)
    return args.output_prefix


if __name__ == "__main__":
    main()

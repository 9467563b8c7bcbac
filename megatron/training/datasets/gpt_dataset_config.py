"""The `GPTDatasetConfig` the command line describes, and a check that a datasets provider honoured it.

`gpt_dataset_config_from_args(args, tokenizer)` carries every data flag into the config: `--data-path` and
`--split`, or `--train-data-path` / `--valid-data-path` / `--test-data-path` (also from
`--per-split-data-args-path`), `--multiple-validation-sets`, `--no-mmap-bin-files`, `--num-dataset-builder-threads`,
`--no-shared-fs`, `--mid-level-dataset-surplus`, the EOD flags. A provider that builds its config by hand may miss a
flag; `check_datasets_follow_flags` (called on the datasets it returns) turns that into an error naming the flag
instead of a silently different run.
"""

from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.utils import blend_from_data_path

PER_SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")


def per_split_blends(args):
    """(train, valid, test) blends from --train/valid/test-data-path, each None where not given; None if none is."""
    paths = (args.train_data_path, args.valid_data_path, args.test_data_path)
    if not any(paths):
        return None
    return tuple(blend_from_data_path(path) if path else None for path in paths)


def gpt_dataset_config_from_args(args, tokenizer):
    per_split = per_split_blends(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend_from_data_path(args.data_path) if args.data_path and per_split is None else None,
        blend_per_split=per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        # The mask is causal, applied in the model; the dataset builds one only for --reset-attention-mask.
        create_attention_mask=args.reset_attention_mask,
        mock=args.mock_data,
        mmap_bin_files=args.mmap_bin_files,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        shared_filesystem=not args.no_shared_fs,
        multiple_validation_sets=getattr(args, "multiple_validation_sets", False),
        mid_level_dataset_surplus=getattr(args, "mid_level_dataset_surplus", 0.005),
    )


def _configs(dataset):
    """The GPTDatasetConfigs behind a dataset this package built (none for other datasets)."""
    if dataset is None:
        return []
    if isinstance(dataset, list):  # --multiple-validation-sets
        return [config for part in dataset for config in _configs(part)]
    config = getattr(dataset, "config", None)
    if isinstance(config, GPTDatasetConfig):
        return [config]
    return [config for part in getattr(dataset, "datasets", None) or [] for config in _configs(part)]


def check_datasets_follow_flags(datasets, args):
    """Raise, naming the flag, when a provider built GPT datasets without a data flag the user gave."""
    wanted = {
        "mmap_bin_files": (getattr(args, "mmap_bin_files", True), "--no-mmap-bin-files"),
        "shared_filesystem": (not getattr(args, "no_shared_fs", False), "--no-shared-fs"),
        "mid_level_dataset_surplus": (getattr(args, "mid_level_dataset_surplus", 0.005), "--mid-level-dataset-surplus"),
    }
    per_split_given = any(getattr(args, name, None) for name in ("train_data_path", "valid_data_path",
                                                                  "test_data_path"))
    for config in (config for dataset in datasets for config in _configs(dataset)):
        if config.mock:  # no files: none of these flags applies
            continue
        ignored = [flag for field, (value, flag) in wanted.items() if getattr(config, field) != value]
        if per_split_given and config.blend_per_split is None:
            ignored.append(" / ".join(PER_SPLIT_FLAGS))
        if ignored:
            raise ValueError(f"the datasets provider built its GPTDatasetConfig without {', '.join(ignored)}; build "
                             "it with megatron.training.datasets.gpt_dataset_config.gpt_dataset_config_from_args("
                             "args, tokenizer)")

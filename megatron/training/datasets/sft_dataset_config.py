"""The `SFTDatasetConfig` the command line describes under `--sft` (megatron/training/datasets/sft_dataset.py)."""

from megatron.core.datasets.utils import blend_from_data_path, parse_split
from megatron.training.datasets.gpt_dataset_config import per_split_blends
from megatron.training.datasets.sft_dataset import SFTDatasetConfig


def sft_dataset_config_from_args(args, tokenizer):
    """`--data-path` (weights and `--split` as for GPT data) or `--train/valid/test-data-path` JSON-lines files,
    `--seq-length`, `--seed`, `--sft-tokenizer-prompt-format`, packing unless `--no-sft-packing` (each conversation
    padded to a multiple of 2 x `--context-parallel-size`), `--multiple-validation-sets`."""
    per_split = per_split_blends(args)
    context_parallel = getattr(args, "context_parallel_size", 1)
    return SFTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        tokenizer=tokenizer,
        blend=blend_from_data_path(args.data_path) if args.data_path and per_split is None else None,
        blend_per_split=per_split,
        split=parse_split(args.split) if per_split is None else (1.0, 0.0, 0.0),
        prompt_format=args.sft_tokenizer_prompt_format,
        pack=args.sft_packing,
        pad_multiple=2 * context_parallel if context_parallel > 1 else 1,
        multiple_validation_sets=getattr(args, "multiple_validation_sets", False),
    )

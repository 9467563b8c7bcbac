"""Data and tokenizer flags."""

import json
import os

from megatron.core.datasets.utils import blend_from_data_path
from megatron.training.tokenizer.arguments import add_tokenizer_file_arguments, vocab_extra_ids_refusal

UNSUPPORTED_FLAGS = (
    ("object_storage_cache_path", "--object-storage-cache-path",
     "reading datasets from object storage is not supported; copy the .bin/.idx files to a local or shared "
     "filesystem and give their path to --data-path"),
    ("s3_cache_path", "--s3-cache-path",
     "reading datasets from S3 is not supported; copy the .bin/.idx files to a local or shared filesystem and give "
     "their path to --data-path"),
)


def add_arguments(parser):
    group = parser.add_argument_group("data")
    group.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="Dataset prefixes, optionally weighted: '0.3 a_text_document 0.7 b_text_document'.",
    )
    group.add_argument("--data-args-path", default=None,
                       help="A file holding the --data-path list (weights and prefixes, whitespace-separated).")
    for split in ("train", "valid", "test"):
        group.add_argument(f"--{split}-data-path", nargs="*", default=None,
                           help=f"The {split} split's own dataset prefixes, weighted like --data-path (instead of "
                           "--data-path with --split).")
    group.add_argument("--per-split-data-args-path", default=None,
                       help='A JSON file {"train": [...], "valid": [...], "test": [...]} giving --train-data-path, '
                       "--valid-data-path and --test-data-path.")
    group.add_argument("--split", default=None,
                       help="Train/valid/test proportions of the --data-path datasets, e.g. '969,30,1' (the default "
                       "there); not with --train/valid/test-data-path, whose splits have their own datasets.")
    group.add_argument("--mock-data", action="store_true", help="Synthetic token ids instead of --data-path.")
    group.add_argument("--data-cache-path", default=None, help="Where dataset index caches are written.")
    group.add_argument(
        "--tokenizer-type",
        default=None,
        help="GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer, ... (default NullTokenizer with --mock-data).",
    )
    add_tokenizer_file_arguments(group)
    group.add_argument("--num-workers", type=int, default=2, help="Data-loader worker processes per rank.")
    group.add_argument("--dataloader-type", default="single", choices=["single", "cyclic", "external"],
                       help="single (default): the samples in the dataset's order; cyclic: a new random order every "
                       "epoch, without end; external: the datasets provider returns the (train, valid, test) "
                       "iterators itself, used as they are.")
    group.add_argument("--no-data-sharding", action="store_false", dest="data_sharding",
                       help="--dataloader-type cyclic: every rank draws from one permutation of the whole epoch "
                       "instead of from its own contiguous bucket of it (the default, as upstream).")
    group.add_argument("--mmap-bin-files", action="store_true", default=True,
                       help="Memory-map the .bin files (the default).")
    group.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                       help="Read each sample's tokens from the .bin files instead of memory-mapping "
                       "them (for filesystems where mapping is slow); nothing of the files is kept in memory.")
    group.add_argument("--num-dataset-builder-threads", type=int, default=1,
                       help="Threads that open datasets and build their indices (per rank).")
    group.add_argument("--mid-level-dataset-surplus", type=float, default=0.005,
                       help="Each dataset of a weighted blend holds ceil(ceil(samples x weight) x (1 + surplus)) "
                       "samples, as upstream; the size sets its epochs and so its shuffles.")
    group.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                       dest="create_attention_mask_in_dataloader",
                       help="Accepted for upstream scripts: the causal mask is always applied in the model; the "
                       "dataset builds a mask only for --reset-attention-mask, which this flag excludes.")
    group.add_argument("--no-shared-fs", action="store_true",
                       help="The dataset index cache (--data-cache-path) is not on a filesystem all nodes share: the "
                       "first rank of each node builds it, instead of global rank 0 only.")
    group.add_argument("--object-storage-cache-path", default=None, help="Not supported (object storage).")
    group.add_argument("--s3-cache-path", default=None, help="Not supported (object storage).")
    group.add_argument("--full-validation", action="store_true",
                       help="Each evaluation runs over the whole validation set (one epoch of its datasets, every "
                       "complete global batch; a last partial one is left out) instead of --eval-iters batches. "
                       "Needs --data-path or --valid-data-path datasets (not --mock-data).")
    group.add_argument("--multiple-validation-sets", action="store_true",
                       help="Evaluate each validation dataset (--valid-data-path A B C, or --data-path A B C with "
                       "--split; given without weights) on its own, with its own validation loss labelled by the "
                       "prefix's file name, instead of one blended validation set.")
    group.add_argument("--reset-position-ids", action="store_true", help="Restart position ids after each EOD.")
    group.add_argument("--reset-attention-mask", action="store_true", help="Block attention across EOD tokens.")
    group.add_argument("--eod-mask-loss", action="store_true", help="Exclude EOD tokens from the loss.")


def _parse_split(split):
    parts = [part.strip() for part in split.replace("/", ",").split(",") if part.strip()]
    try:
        weights = [float(part) for part in parts]
    except ValueError:
        raise ValueError(f"--split must be comma-separated numbers like '969,30,1', got {split!r}") from None
    if not 1 <= len(weights) <= 3 or any(weight < 0 for weight in weights) or sum(weights) <= 0:
        raise ValueError(f"--split needs one to three non-negative numbers with a positive sum, got {split!r}")
    return weights + [0.0] * (3 - len(weights))


def _read_data_args_files(args):
    """--data-args-path fills --data-path, --per-split-data-args-path the three per-split paths."""
    if args.data_args_path is not None:
        if args.data_path:
            raise ValueError("--data-path and --data-args-path are exclusive: pick one")
        if not os.path.isfile(args.data_args_path):
            raise ValueError(f"--data-args-path {args.data_args_path}: no such file")
        with open(args.data_args_path) as stream:
            args.data_path = stream.read().split()
        if not args.data_path:
            raise ValueError(f"--data-args-path {args.data_args_path} is empty; it should hold the --data-path list")
    if args.per_split_data_args_path is None:
        return
    if args.train_data_path or args.valid_data_path or args.test_data_path:
        raise ValueError("--per-split-data-args-path and --train/valid/test-data-path are exclusive: pick one")
    try:
        with open(args.per_split_data_args_path) as stream:
            per_split = json.load(stream)
    except (OSError, ValueError) as error:
        raise ValueError(f"--per-split-data-args-path {args.per_split_data_args_path}: {error}") from None
    unknown = set(per_split) - {"train", "valid", "test"} if isinstance(per_split, dict) else {"(not an object)"}
    if unknown:
        raise ValueError(f"--per-split-data-args-path {args.per_split_data_args_path} must be a JSON object with "
                         f'keys "train", "valid", "test"; found {sorted(unknown)}')
    for split, paths in per_split.items():
        words = paths.split() if isinstance(paths, str) else [str(path) for path in paths or []]
        setattr(args, f"{split}_data_path", words or None)


def _validate_dataset_flags(args):
    for attribute, flag, instead in UNSUPPORTED_FLAGS:
        if getattr(args, attribute):
            raise ValueError(f"{flag} is not supported: {instead}")
    if args.num_dataset_builder_threads < 1:
        raise ValueError(f"--num-dataset-builder-threads must be at least 1, got {args.num_dataset_builder_threads}")
    if args.mid_level_dataset_surplus < 0:
        raise ValueError(f"--mid-level-dataset-surplus must be >= 0, got {args.mid_level_dataset_surplus}")
    if not args.create_attention_mask_in_dataloader and args.reset_attention_mask:
        raise ValueError("--reset-attention-mask needs the dataset's attention mask (it blocks attention across "
                         "documents): drop --no-create-attention-mask-in-dataloader")


def _validate_validation_flags(args, per_split):
    chosen = [flag for flag, on in (("--full-validation", args.full_validation),
                                    ("--multiple-validation-sets", args.multiple_validation_sets)) if on]
    if not chosen:
        return
    flags = f"{' and '.join(chosen)} {'need' if len(chosen) > 1 else 'needs'}"
    if args.mock_data:
        raise ValueError(f"{flags} validation datasets of a known size, given as --data-path or --valid-data-path "
                         "prefixes; --mock-data has one endless synthetic set (use --eval-iters)")
    if args.dataloader_type == "external":
        raise ValueError(f"{flags} the validation datasets themselves; with --dataloader-type external the "
                         "provider returns iterators: use --dataloader-type single or cyclic")
    validation_paths = args.valid_data_path if per_split else args.data_path
    if args.multiple_validation_sets and validation_paths and blend_from_data_path(validation_paths)[1] is not None:
        flag = "--valid-data-path" if per_split else "--data-path"
        raise ValueError(f"--multiple-validation-sets evaluates each validation dataset on its own, so {flag} must "
                         f"list prefixes without weights (got {' '.join(validation_paths)})")


def _check_tokenizer_type(tokenizer_type):
    """Upstream's argparse choices, checked here so that a misspelt or upstream-only type stops before start-up."""
    from megatron.training.tokenizer.tokenizer import TOKENIZER_TYPES

    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"--tokenizer-type {tokenizer_type} is not one of {', '.join(TOKENIZER_TYPES)}")


def validate(args):
    _read_data_args_files(args)
    _validate_dataset_flags(args)
    per_split = bool(args.train_data_path or args.valid_data_path or args.test_data_path)
    if per_split and args.data_path:
        raise ValueError("--data-path (with --split) and --train-data-path / --valid-data-path / --test-data-path "
                         "are exclusive: give the datasets one way")
    if per_split and not args.train_data_path and not getattr(args, "skip_train", False):
        # As upstream, evaluating a loaded model alone (--skip-train) needs no training data.
        raise ValueError("--valid-data-path / --test-data-path need --train-data-path too (or use --data-path), "
                         "unless only evaluating with --skip-train")
    if args.mock_data and (args.data_path or per_split):
        given = "--data-path" if args.data_path else "--train/valid/test-data-path"
        raise ValueError(f"--mock-data and {given} are exclusive: pick one")
    if not args.mock_data and not args.data_path and not per_split:
        raise ValueError("give --data-path PREFIX [...], --train-data-path PREFIX [...] or --mock-data")
    _validate_validation_flags(args, per_split)
    if per_split and args.split is not None:
        raise ValueError(f"--split {args.split} divides the --data-path datasets into train/valid/test; with "
                         "--train-data-path / --valid-data-path / --test-data-path (or --per-split-data-args-path) "
                         "each split reads all the documents of its own datasets: drop --split (upstream refuses "
                         "the two together too: 'split and blend_per_split are incompatible')")
    if args.split is None and not per_split:
        args.split = "969, 30, 1"  # upstream's legacy default for --data-path
    args.split_weights = None if args.split is None else _parse_split(args.split)
    if args.tokenizer_type is None:
        args.tokenizer_type = "NullTokenizer" if args.mock_data else None
        if args.tokenizer_type is None:
            raise ValueError("--tokenizer-type is required with --data-path / --train-data-path")
    _check_tokenizer_type(args.tokenizer_type)
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.tokenizer_type == "TikTokenizer":
        if args.tokenizer_model is None or args.tiktoken_pattern is None:
            raise ValueError("--tokenizer-type TikTokenizer needs --tokenizer-model (the .json vocabulary) and "
                             "--tiktoken-pattern v1|v2")
        if args.tiktoken_num_special_tokens is None:
            args.tiktoken_num_special_tokens = 1000
        if args.tiktoken_num_special_tokens < 3:
            raise ValueError("--tiktoken-num-special-tokens must be >= 3 (<unk>, <s>, </s>), got "
                             f"{args.tiktoken_num_special_tokens}")
    elif (args.tiktoken_pattern, args.tiktoken_special_tokens, args.tiktoken_num_special_tokens) != (None,) * 3:
        raise ValueError("--tiktoken-pattern / --tiktoken-special-tokens / --tiktoken-num-special-tokens need "
                         "--tokenizer-type TikTokenizer")
    from megatron.training.tokenizer.tokenizer import HUGGING_FACE_TYPES, SENTENCEPIECE_TOKENIZER_TYPES

    if args.trust_remote_code and args.tokenizer_type not in HUGGING_FACE_TYPES:
        raise ValueError(f"--trust-remote-code applies to --tokenizer-type HuggingFaceTokenizer (loading a "
                         f"--tokenizer-model directory); --tokenizer-type {args.tokenizer_type} runs no tokenizer "
                         "code: drop the flag")
    if args.tokenizer_type == "GPT2BPETokenizer" and (args.vocab_file is None or args.merge_file is None):
        raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    if args.tokenizer_type in HUGGING_FACE_TYPES and args.tokenizer_model is None:
        raise ValueError(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model (a Hugging Face tokenizer "
                         "directory or name, or a tokenizer.json file)")
    if args.tokenizer_type in SENTENCEPIECE_TOKENIZER_TYPES and args.tokenizer_model is None:
        raise ValueError(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model (the SentencePiece .model "
                         "file)")
    refusal = vocab_extra_ids_refusal(args.vocab_extra_ids, args.tokenizer_type)
    if refusal:
        raise ValueError(refusal)
    if args.num_workers < 0:
        raise ValueError(f"--num-workers must be >= 0, got {args.num_workers}")

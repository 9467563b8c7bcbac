"""Data and tokenizer flags."""


def add_arguments(parser):
    group = parser.add_argument_group("data")
    group.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="Dataset prefixes, optionally weighted: '0.3 a_text_document 0.7 b_text_document'.",
    )
    group.add_argument("--split", default="969, 30, 1", help="Train/valid/test proportions, e.g. '969,30,1'.")
    group.add_argument("--mock-data", action="store_true", help="Synthetic token ids instead of --data-path.")
    group.add_argument("--data-cache-path", default=None, help="Where dataset index caches are written.")
    group.add_argument(
        "--tokenizer-type",
        default=None,
        help="GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer, ... (default NullTokenizer with --mock-data).",
    )
    group.add_argument("--vocab-file", default=None)
    group.add_argument("--merge-file", default=None)
    group.add_argument("--tokenizer-model", default=None,
                       help="Tokenizer file or name (HuggingFaceTokenizer), or the .json vocabulary (TikTokenizer).")
    group.add_argument("--tiktoken-pattern", default=None, choices=["v1", "v2"],
                       help="TikTokenizer pre-tokenizer: v1 splits numbers into digits, v2 into groups of three.")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=None,
                       help="TikTokenizer ids reserved for special tokens (the BPE ids follow them); default 1000.")
    group.add_argument("--tiktoken-special-tokens", nargs="+", default=None,
                       help="TikTokenizer special tokens (must include <unk>, <s>, </s>); default <unk> <s> </s> "
                       "<mask> <pad> <cls> <sep>.")
    group.add_argument("--num-workers", type=int, default=2, help="Data-loader worker processes per rank.")
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


def validate(args):
    if args.mock_data and args.data_path:
        raise ValueError("--mock-data and --data-path are exclusive: pick one")
    if not args.mock_data and not args.data_path:
        raise ValueError("give --data-path PREFIX [...] or --mock-data")
    args.split_weights = _parse_split(args.split)
    if args.tokenizer_type is None:
        args.tokenizer_type = "NullTokenizer" if args.mock_data else None
        if args.tokenizer_type is None:
            raise ValueError("--tokenizer-type is required with --data-path")
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
    if args.tokenizer_type == "GPT2BPETokenizer" and (args.vocab_file is None or args.merge_file is None):
        raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    if args.num_workers < 0:
        raise ValueError(f"--num-workers must be >= 0, got {args.num_workers}")

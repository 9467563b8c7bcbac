"""Supervised fine-tuning flags (`pretrain_gpt.py --sft`; megatron/training/datasets/sft_dataset.py)."""

from megatron.training.tokenizer.chat_prompt_formats import DEFAULT_PROMPT_FORMAT, PROMPT_FORMATS, prompt_format

# Flags that shape GPT pretraining samples; SFT samples set their own positions, masks and end-of-document ids.
PRETRAINING_SAMPLE_FLAGS = (("reset_position_ids", "--reset-position-ids"),
                            ("reset_attention_mask", "--reset-attention-mask"),
                            ("eod_mask_loss", "--eod-mask-loss"))


def add_arguments(parser):
    group = parser.add_argument_group("supervised fine-tuning")
    group.add_argument("--sft", action="store_true",
                       help="Train on chat conversations: --data-path (or --train-data-path ...) names JSON-lines "
                       "files of {\"messages\": [{\"role\", \"content\"}, ...]}; the loss covers the assistant's "
                       "replies only.")
    group.add_argument("--sft-tokenizer-prompt-format", default=None,
                       help=f"How --sft renders a conversation as text: {', '.join(sorted(PROMPT_FORMATS))} "
                       f"(default {DEFAULT_PROMPT_FORMAT}).")
    group.add_argument("--no-sft-packing", action="store_false", dest="sft_packing",
                       help="With --sft: one conversation per sample, padded to --seq-length (any --micro-batch-size), "
                       "instead of conversations packed into rows that each take a whole micro-batch.")


def validate(args):
    if not args.sft:
        given = [flag for flag, on in (("--sft-tokenizer-prompt-format", args.sft_tokenizer_prompt_format),
                                       ("--no-sft-packing", not args.sft_packing)) if on]
        if given:
            raise ValueError(f"{' and '.join(given)} {'set' if len(given) > 1 else 'sets'} up supervised fine-tuning "
                             "data: add --sft")
        return
    if args.sft_tokenizer_prompt_format is None:
        args.sft_tokenizer_prompt_format = DEFAULT_PROMPT_FORMAT
    prompt_format(args.sft_tokenizer_prompt_format)
    if args.mock_data:
        raise ValueError("--sft trains on conversations from JSON-lines files: give them with --data-path (or "
                         "--train-data-path ...) instead of --mock-data")
    if args.tokenizer_type == "NullTokenizer":
        raise ValueError("--sft renders conversations as text, which --tokenizer-type NullTokenizer cannot tokenize: "
                         "choose a text tokenizer (e.g. ByteLevelTokenizer or HuggingFaceTokenizer)")
    for attribute, flag in PRETRAINING_SAMPLE_FLAGS:
        if getattr(args, attribute):
            raise ValueError(f"{flag} shapes pretraining samples; --sft samples keep each conversation apart and "
                             f"train only on the assistant's replies: drop {flag}")
    if args.sft_packing and args.micro_batch_size != 1:
        raise ValueError(f"--sft packs conversations into rows that each make a whole micro-batch, so it needs "
                         f"--micro-batch-size 1 (got {args.micro_batch_size}; raise --seq-length or "
                         "--global-batch-size for more tokens per step), or give --no-sft-packing for one padded "
                         "conversation per sample")

"""`build_tokenizer` (the `--tokenizer-type` switch) and the vocabulary padding rule of the training code."""

from megatron.training.tokenizer.arguments import vocab_extra_ids_refusal
from megatron.training.tokenizer.byte_level_tokenizer import ByteLevelTokenizer
from megatron.training.tokenizer.gpt2_bpe_tokenizer import GPT2BPETokenizer
from megatron.training.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer, loads_with_auto_tokenizer
from megatron.training.tokenizer.null_tokenizer import NullTokenizer
from megatron.training.tokenizer.sentencepiece_tokenizer import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from megatron.training.tokenizer.sft_tokenizer import SFTTokenizer
from megatron.training.tokenizer.tiktoken_tokenizer import DEFAULT_NUM_SPECIAL_TOKENS, TikTokenizer

# Upstream's class names, imported by scripts written for it.
_NullTokenizer = NullTokenizer
_GPT2BPETokenizer = GPT2BPETokenizer
_HuggingFaceTokenizer = HuggingFaceTokenizer
CustomTikTokenizer = TikTokenizer
_SentencePieceTokenizer = SentencePieceTokenizer
_GPTSentencePieceTokenizer = GPTSentencePieceTokenizer
_Llama2Tokenizer = Llama2Tokenizer

# Upstream's types that read a SentencePiece .model file with the sentencepiece package.
SENTENCEPIECE_TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TOKENIZER_TYPES = ("NullTokenizer", "ByteLevelTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer",
                   "TikTokenizer", "SFTTokenizer") + SENTENCEPIECE_TOKENIZER_TYPES
# Types loading --tokenizer-model with transformers.AutoTokenizer (or the tokenizers package).
HUGGING_FACE_TYPES = ("HuggingFaceTokenizer", "SFTTokenizer")


def build_tokenizer(tokenizer_type, vocab_size=None, vocab_file=None, merge_file=None, tokenizer_model=None,
                    tiktoken_pattern=None, tiktoken_num_special_tokens=DEFAULT_NUM_SPECIAL_TOKENS,
                    tiktoken_special_tokens=None, trust_remote_code=False, vocab_extra_ids=0,
                    sft_tokenizer_prompt_format=None, **from_pretrained_kwargs):
    """The tokenizer named by `--tokenizer-type`, built from the file/size flags that type needs.

    Called as upstream's `build_tokenizer(args, **kwargs)` with the parsed arguments instead of a type name, it
    reads the flags from `args`, sets `args.padded_vocab_size` and prints upstream's start-up lines on rank 0.
    Further keywords (`padding_side="left"`, ...) go to HuggingFaceTokenizer's
    `transformers.AutoTokenizer.from_pretrained`, as upstream's; the other types take none."""
    if not isinstance(tokenizer_type, str) and hasattr(tokenizer_type, "tokenizer_type"):
        flags_given = [name for name, value, default in (
            ("vocab_size", vocab_size, None), ("vocab_file", vocab_file, None), ("merge_file", merge_file, None),
            ("tokenizer_model", tokenizer_model, None), ("tiktoken_pattern", tiktoken_pattern, None),
            ("tiktoken_num_special_tokens", tiktoken_num_special_tokens, DEFAULT_NUM_SPECIAL_TOKENS),
            ("tiktoken_special_tokens", tiktoken_special_tokens, None),
            ("trust_remote_code", trust_remote_code, False), ("vocab_extra_ids", vocab_extra_ids, 0),
            ("sft_tokenizer_prompt_format", sft_tokenizer_prompt_format, None))
            if value != default]
        if flags_given:
            raise TypeError(f"build_tokenizer(args, ...) reads {', '.join(flags_given)} from args; set them on args "
                            "(the keywords after args go to transformers.AutoTokenizer.from_pretrained)")
        return _build_tokenizer_as_upstream(tokenizer_type, **from_pretrained_kwargs)
    if from_pretrained_kwargs and tokenizer_type not in HUGGING_FACE_TYPES:
        raise ValueError(f"build_tokenizer keywords {', '.join(sorted(from_pretrained_kwargs))} go to "
                         "transformers.AutoTokenizer.from_pretrained, which only --tokenizer-type HuggingFaceTokenizer "
                         f"uses; --tokenizer-type {tokenizer_type} takes none: drop them")
    if vocab_extra_ids_refusal(vocab_extra_ids or 0, tokenizer_type):
        raise ValueError(vocab_extra_ids_refusal(vocab_extra_ids, tokenizer_type))
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    if tokenizer_type == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model, trust_remote_code=trust_remote_code, **from_pretrained_kwargs)
    if tokenizer_type == "SFTTokenizer":
        return SFTTokenizer(tokenizer_model, sft_tokenizer_prompt_format, trust_remote_code=trust_remote_code,
                            **from_pretrained_kwargs)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "TikTokenizer":
        if tokenizer_model is None or tiktoken_pattern is None:
            raise ValueError("--tokenizer-type TikTokenizer needs --tokenizer-model and --tiktoken-pattern")
        return TikTokenizer(tokenizer_model, tiktoken_pattern, vocab_size, tiktoken_num_special_tokens,
                            tiktoken_special_tokens)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model, vocab_extra_ids=vocab_extra_ids or 0)
    if tokenizer_type == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "Llama2Tokenizer":
        return Llama2Tokenizer(tokenizer_model)
    raise ValueError(f"unknown --tokenizer-type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}")


def build_tokenizer_from_args(args, **from_pretrained_kwargs):
    """`build_tokenizer` reading `tokenizer_type`, `vocab_size`, `vocab_file`, `merge_file`, `tokenizer_model`,
    the tiktoken settings and `trust_remote_code`; `from_pretrained_kwargs` as `build_tokenizer`'s, with
    `use_fast=True` for a HuggingFaceTokenizer directory under `--tokenizer-hf-use-fast`."""
    if (getattr(args, "tokenizer_hf_use_fast", False) and args.tokenizer_type in HUGGING_FACE_TYPES
            and loads_with_auto_tokenizer(args.tokenizer_model)):
        from_pretrained_kwargs.setdefault("use_fast", True)
    return build_tokenizer(
        args.tokenizer_type,
        vocab_size=getattr(args, "vocab_size", None),
        vocab_file=getattr(args, "vocab_file", None),
        merge_file=getattr(args, "merge_file", None),
        tokenizer_model=getattr(args, "tokenizer_model", None),
        tiktoken_pattern=getattr(args, "tiktoken_pattern", None),
        tiktoken_num_special_tokens=getattr(args, "tiktoken_num_special_tokens", None) or DEFAULT_NUM_SPECIAL_TOKENS,
        tiktoken_special_tokens=getattr(args, "tiktoken_special_tokens", None),
        trust_remote_code=getattr(args, "trust_remote_code", False),
        vocab_extra_ids=getattr(args, "vocab_extra_ids", 0),
        sft_tokenizer_prompt_format=getattr(args, "sft_tokenizer_prompt_format", None),
        **from_pretrained_kwargs,
    )


def _build_tokenizer_as_upstream(args, **from_pretrained_kwargs):
    """Upstream's `build_tokenizer(args, **kwargs)`: the tokenizer of `args`, with `args.padded_vocab_size` padded
    from it."""
    if getattr(args, "rank", 0) == 0:
        print(f"> building {args.tokenizer_type} tokenizer ...", flush=True)
    tokenizer = build_tokenizer_from_args(args, **from_pretrained_kwargs)
    args.padded_vocab_size = padded_vocab_size(args, tokenizer.vocab_size)
    if getattr(args, "rank", 0) == 0:
        print(padded_vocab_message(tokenizer.vocab_size, args.padded_vocab_size), flush=True)
    return tokenizer


def _vocab_size_with_padding(orig_vocab_size, args, logging_enabled=True):
    """Upstream's helper: `orig_vocab_size` padded to a multiple of --make-vocab-size-divisible-by x TP size,
    logged on rank 0 with upstream's line."""
    padded = pad_vocab_size(orig_vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    if logging_enabled and getattr(args, "rank", 0) == 0:
        print(padded_vocab_message(orig_vocab_size, padded), flush=True)
    return padded


def padded_vocab_message(orig_vocab_size, padded_vocab_size):
    """Upstream's start-up line for the vocabulary padding."""
    return (f" > padded vocab (size: {orig_vocab_size}) with {padded_vocab_size - orig_vocab_size} dummy tokens "
            f"(new size: {padded_vocab_size})")


def pad_vocab_size(orig_vocab_size, make_vocab_size_divisible_by, tensor_model_parallel_size=1):
    """Round the vocabulary up to a multiple of `--make-vocab-size-divisible-by` x TP size.

    The embedding is split by rows across tensor-parallel ranks, and each shard should have an
    efficient size, hence the product.
    """
    if orig_vocab_size < 1:
        raise ValueError(f"vocabulary size must be positive (got {orig_vocab_size})")
    if make_vocab_size_divisible_by < 1:
        raise ValueError(f"--make-vocab-size-divisible-by must be positive (got {make_vocab_size_divisible_by})")
    if tensor_model_parallel_size < 1:
        raise ValueError(f"--tensor-model-parallel-size must be positive (got {tensor_model_parallel_size})")
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-orig_vocab_size // multiple) * multiple


def padded_vocab_size(args, vocab_size) -> int:
    """The rows of the word embedding and output layer for a tokenizer of `vocab_size` tokens: the vocabulary
    padded to a multiple of --make-vocab-size-divisible-by x TP size, or, with --use-checkpoint-args, the
    checkpoint's rows (`apply_checkpoint_args` set them), which must cover the tokens and split over TP."""
    tp = args.tensor_model_parallel_size
    rows = getattr(args, "padded_vocab_size", None) if getattr(args, "use_checkpoint_args", False) else None
    if rows is None:
        return pad_vocab_size(vocab_size, args.make_vocab_size_divisible_by, tp)
    if rows < vocab_size:
        raise ValueError(
            f"--use-checkpoint-args: the checkpoint's word embedding has {rows} rows, fewer than the {vocab_size} "
            "tokens of this run's tokenizer; launch with the tokenizer the checkpoint was trained with "
            "(--tokenizer-type, --vocab-size and its files)")
    if rows % tp:
        raise ValueError(
            f"--use-checkpoint-args: the checkpoint's word embedding has {rows} rows (its padded vocabulary), which "
            f"do not split over --tensor-model-parallel-size {tp}; resume at a TP size that divides {rows}, or "
            "without --use-checkpoint-args, giving the model flags (a torch_dist load then pads the rows to "
            "--make-vocab-size-divisible-by x TP, changing the padding rows)")
    return rows


def exact_padding_divisor(vocab_size, padded_vocab_size, tensor_model_parallel_size=1, preferred=None):
    """The `--make-vocab-size-divisible-by` that pads `vocab_size` tokens to exactly `padded_vocab_size` rows at
    this TP size (`pad_vocab_size` gives ceil(tokens / (D x TP)) x D x TP): `preferred` where it does, else the
    smallest that does (the one most TP sizes share); None where none does at this TP size."""
    if not 0 < vocab_size <= padded_vocab_size or tensor_model_parallel_size < 1:
        return None

    def pads_exactly(divisor):
        multiple = divisor * tensor_model_parallel_size
        return padded_vocab_size % multiple == 0 and padded_vocab_size - multiple < vocab_size

    if preferred is not None and preferred > 0 and pads_exactly(preferred):
        return preferred
    return next((divisor for divisor in range(1, padded_vocab_size // tensor_model_parallel_size + 1)
                 if pads_exactly(divisor)), None)
